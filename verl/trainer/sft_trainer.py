"""`python -m verl.trainer.sft_trainer <verl keys>`, and `torchrun --nproc_per_node=N -m
verl.trainer.sft_trainer ...` whose ranks each run it, is `alignrl train sft <verl keys>`: the command lines of
verl's SFT trainer, read by `alignrl.preference.verl_sft_keys`."""

import sys

try:
    from alignrl.cli import main
except ModuleNotFoundError as e:  # run by a Python that alignrl is not installed in
    if (e.name or "").split(".")[0] != "alignrl":
        raise
    sys.exit(f"python -m verl.trainer.sft_trainer: {sys.executable} cannot import {e.name}: alignrl is not "
             "installed in this Python; run it from the environment alignrl is installed in (`make install`)")

if __name__ == "__main__":
    sys.exit(main(["train", "sft", *sys.argv[1:]]))
