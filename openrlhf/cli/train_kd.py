"""`python3 -m openrlhf.cli.train_kd <OpenRLHF flags>` (as OpenRLHF's scripts launch distillation) is
`alignrl train kd <OpenRLHF flags>`."""

import sys

try:
    from alignrl.cli import main
except ModuleNotFoundError as e:  # another Python than the one alignrl is installed in
    if (e.name or "").split(".")[0] != "alignrl":
        raise
    sys.exit(f"python3 -m openrlhf.cli.train_kd: {sys.executable} cannot import {e.name}: alignrl is not installed "
             "in this Python; run it from the environment alignrl is installed in (`make install`)")

if __name__ == "__main__":
    sys.exit(main(["train", "kd", *sys.argv[1:]]))
