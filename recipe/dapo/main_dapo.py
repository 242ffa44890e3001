"""`python3 -m recipe.dapo.main_dapo <verl overrides>` is `alignrl train ppo <verl overrides>`: DAPO's spellings
(algorithm.filter_groups.*, reward_model.overlong_buffer.*, reward_model.reward_manager=dapo) translate to alignrl's
dynamic sampling and overlong penalty, as verl's own keys do."""

import sys

from alignrl.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", "ppo", *sys.argv[1:]]))
