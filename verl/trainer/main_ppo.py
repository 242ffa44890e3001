"""`python3 -m verl.trainer.main_ppo <verl overrides>` is `alignrl train ppo <verl overrides>` (as Search-R1's scripts call it); inside
`ray job submit` (RAY_ADDRESS set) the run is placed on the cluster as verl's hybrid engine places it."""

import sys

try:
    from alignrl.cli import main
except ModuleNotFoundError as e:  # a Ray started from another Python runs the job's command with that Python
    if (e.name or "").split(".")[0] != "alignrl":
        raise
    sys.exit(f"python3 -m verl.trainer.main_ppo: {sys.executable} cannot import {e.name}: alignrl is not installed "
             "in this Python; run it (and `ray start`, whose Python runs `ray job submit` commands) from the "
             "environment alignrl is installed in (`make install`, then .venv/bin/ray start ...)")

if __name__ == "__main__":
    sys.exit(main(["train", "ppo", *sys.argv[1:]]))
