"""`python3 -m openrlhf.cli.train_opd <OpenRLHF flags>` is `alignrl train opd <OpenRLHF flags>`."""

from openrlhf.cli import run_as

if __name__ == "__main__":
    run_as(["train", "opd"], "train_opd")
