"""`python -m verl.trainer.sft_trainer <verl keys>`, and `torchrun --nproc_per_node=N -m
verl.trainer.sft_trainer ...` whose ranks each run it, is `alignrl train sft <verl keys>`: the command lines of
verl's SFT trainer, read by `alignrl.preference.verl_sft_keys`."""

import sys


def run(module: str) -> int | str:
    """`alignrl train sft` on this process's arguments; a one-line message when alignrl is not installed here."""
    try:
        from alignrl.cli import main
    except ModuleNotFoundError as e:  # run by a Python that alignrl is not installed in
        if (e.name or "").split(".")[0] != "alignrl":
            raise
        return (f"python -m {module}: {sys.executable} cannot import {e.name}: alignrl is not installed in this "
                "Python; run it from the environment alignrl is installed in (`make install`)")
    return main(["train", "sft", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(run("verl.trainer.sft_trainer"))
