"""`python3 -m verl.trainer.main_ppo <verl overrides>` is `alignrl train ppo <verl overrides>` (seed 003); inside
`ray job submit` (RAY_ADDRESS set) the run is placed on the cluster as verl's hybrid engine places it."""

import sys

from alignrl.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", "ppo", *sys.argv[1:]]))
