"""`python3 -m openrlhf.cli.train_ppo_ray <OpenRLHF flags>` is `alignrl train ppo-ray <OpenRLHF flags>`."""

from openrlhf.cli import run_as

if __name__ == "__main__":
    run_as(["train", "ppo-ray"], "train_ppo_ray")
