#!/usr/bin/env python
"""CPU seconds of one `load_config` with a command line's overrides, against the same load with a copying merge.

    python benchmarks/config_load.py [--rounds 20]

Every rank, sampler and command of a run loads its config once, and a test suite over a thousand times. The overrides
are merged one at a time (an error names its own override); `load_config` merges each into the load's own tree in
place (`OmegaConf.unsafe_merge`). The peer is the same load with `OmegaConf.merge`, which copies the whole tree for
each override. The command line: seed 003's verl PPO arguments (27 overrides) and a short GRPO one (6). Prints
each one's median CPU milliseconds and `ratio = X.XXx` (copying / in place, the long command line).
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

from omegaconf import OmegaConf

from alignrl.config import load as config_load
from alignrl.config import load_config

VERL_PPO = ["data.train_batch_size=4", "data.val_data_num=4", "data.max_prompt_length=64",
            "data.max_response_length=8", "data.shuffle_train_dataloader=True", "algorithm.adv_estimator=gae",
            "actor_rollout_ref.model.path=/models/base", "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size=2",
            "actor_rollout_ref.rollout.n_agent=1", "actor_rollout_ref.rollout.temperature=1",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.name=vllm",
            "critic.optim.lr=1e-3", "critic.model.path=/models/base", "critic.ppo_micro_batch_size=2",
            "algorithm.kl_ctrl.kl_coef=0.001", "trainer.critic_warmup=0", "trainer.logger=['console','jsonl']",
            "trainer.n_gpus_per_node=1", "trainer.nnodes=2", "trainer.save_freq=1", "trainer.test_freq=0",
            "trainer.project_name=p", "trainer.experiment_name=e", "trainer.total_training_steps=3"]
GRPO = ["model.path=/models/base", "rollout.n=4", "actor.lr=1e-5", "trainer.total_training_steps=10",
        "data.train_batch_size=8", "actor.ppo_mini_batch_size=8"]


class CopyingMerge(OmegaConf):
    """OmegaConf with `unsafe_merge` as its copying `merge`: the peer."""
    unsafe_merge = staticmethod(OmegaConf.merge)


def cpu_ms(overrides: list[str], rounds: int) -> float:
    load_config(None, overrides)  # imports and first-use caches out of the count
    times = []
    for _ in range(rounds):
        start = time.process_time()
        load_config(None, overrides)
        times.append(1000 * (time.process_time() - start))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    results = {}
    for name, overrides in (("verl ppo (27 overrides)", VERL_PPO), ("grpo (6 overrides)", GRPO)):
        in_place = cpu_ms(overrides, args.rounds)
        with mock.patch.object(config_load, "OmegaConf", CopyingMerge):
            copying = cpu_ms(overrides, args.rounds)
        results[name] = (in_place, copying)
        print(f"{name:24s} in place {in_place:6.1f} ms, copying merge {copying:6.1f} ms ({copying / in_place:.2f}x)")
    in_place, copying = results["verl ppo (27 overrides)"]
    print(f"ratio = {copying / in_place:.2f}x (copying merge / in place, seed 003's command line; CPU ms a load)")


if __name__ == "__main__":
    main()
