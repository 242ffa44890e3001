"""`python3 -m openrlhf.cli.train_kd <OpenRLHF flags>` is `alignrl train kd <OpenRLHF flags>`."""

from openrlhf.cli import run_as

if __name__ == "__main__":
    run_as(["train", "kd"], "train_kd")
