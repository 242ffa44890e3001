"""`python3 -m openrlhf.cli.train_ppo_ray <OpenRLHF flags>` (as OpenRLHF's and LMM-R1's scripts submit it to Ray) is
`alignrl train ppo-ray <OpenRLHF flags>`."""

import sys

try:
    from alignrl.cli import main
except ModuleNotFoundError as e:  # a Ray started from another Python runs the job's command with that Python
    if (e.name or "").split(".")[0] != "alignrl":
        raise
    sys.exit(f"python3 -m openrlhf.cli.train_ppo_ray: {sys.executable} cannot import {e.name}: alignrl is not "
             "installed in this Python; run it (and `ray start`) from the environment alignrl is installed in "
             "(`make install`, then .venv/bin/ray start ...)")

if __name__ == "__main__":
    sys.exit(main(["train", "ppo-ray", *sys.argv[1:]]))
