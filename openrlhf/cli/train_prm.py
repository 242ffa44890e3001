"""`python3 -m openrlhf.cli.train_prm <OpenRLHF flags>` (as OpenRLHF's train_prm scripts run it, under deepspeed or
torchrun) is `alignrl train prm <OpenRLHF flags>`."""

import sys

try:
    from alignrl.cli import main
except ModuleNotFoundError as e:  # another Python than the one alignrl is installed in
    if (e.name or "").split(".")[0] != "alignrl":
        raise
    sys.exit(f"python3 -m openrlhf.cli.train_prm: {sys.executable} cannot import {e.name}: alignrl is not "
             "installed in this Python; run it from the environment alignrl is installed in (`make install`)")

if __name__ == "__main__":
    sys.exit(main(["train", "prm", *sys.argv[1:]]))
