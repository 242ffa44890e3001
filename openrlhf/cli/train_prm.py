"""`python3 -m openrlhf.cli.train_prm <OpenRLHF flags>` is `alignrl train prm <OpenRLHF flags>`."""

from openrlhf.cli import run_as

if __name__ == "__main__":
    run_as(["train", "prm"], "train_prm")
