"""`python -m verl.trainer.fsdp_sft_trainer <verl keys>`, and `torchrun --nproc_per_node=N -m
verl.trainer.fsdp_sft_trainer ...` whose ranks each run it, is `alignrl train sft <verl keys>`: the command lines of
verl's older FSDP SFT trainer, read by `alignrl.preference.verl_sft_keys`."""

import sys

from verl.trainer.sft_trainer import run

if __name__ == "__main__":
    sys.exit(run("verl.trainer.fsdp_sft_trainer"))
