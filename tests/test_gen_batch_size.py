"""data.gen_batch_size (verl's, DAPO's gen_prompt_bsz): with dynamic sampling every generation round draws that many
prompts, the first data.train_batch_size groups kept are trained, and an epoch is the rows over it; verl's spelling
without the filter is the training batch."""

import json

import pytest
import torch

from alignrl.config import ConfigError, check_world_size, load_config
from alignrl.config.counts import resolve_counts
from alignrl.data.sampler import BatchSampler
from alignrl.data.loaders import DataError
from alignrl.runner import train_grpo
from smallrun import overrides

BATCH = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4"]
DAPO = ["algorithm.dynamic_sampling=true", *BATCH]


def test_draw_size_is_the_generation_batch_with_dynamic_sampling_and_the_training_batch_otherwise():
    assert load_config(None, DAPO + ["data.gen_batch_size=12"]).data.draw_size == 12
    assert load_config(None, DAPO).data.draw_size == 4
    assert load_config(None, BATCH + ["data.gen_batch_size=4"]).data.draw_size == 4  # the same


def test_a_generation_batch_without_dynamic_sampling_is_one_line():
    with pytest.raises(ConfigError, match=r"data.gen_batch_size=12 is read only with algorithm.dynamic_sampling=true"
                       r".*set data.train_batch_size instead"):
        load_config(None, BATCH + ["data.gen_batch_size=12"])


def test_every_rank_takes_an_equal_share_of_a_generation_batch():
    cfg = load_config(None, DAPO + ["data.gen_batch_size=6"])
    check_world_size(cfg, 2)
    with pytest.raises(ConfigError, match="data.gen_batch_size=6 must be a multiple of the world size 4"):
        check_world_size(replace_train(cfg, 8), 4)


def replace_train(cfg, size):
    from dataclasses import replace

    return replace(cfg, data=replace(cfg.data, train_batch_size=size), actor=replace(cfg.actor, ppo_mini_batch_size=4))


def test_an_epoch_is_the_rows_over_the_generation_batch():
    cfg = load_config(None, DAPO + ["data.gen_batch_size=12", "data.train_size=100", "trainer.total_epochs=2"])
    assert resolve_counts(cfg, {"trainer.total_epochs"}).trainer.total_training_steps == 2 * (100 // 12)
    plain = load_config(None, DAPO + ["data.train_size=100", "trainer.total_epochs=2"])
    assert resolve_counts(plain, {"trainer.total_epochs"}).trainer.total_training_steps == 2 * (100 // 4)


def test_too_few_rows_for_a_generation_batch_names_both_keys():
    with pytest.raises(DataError, match="training data has 10 rows but a step draws 12 prompts .*data.gen_batch_size"):
        BatchSampler(10, 12, seed=0)


def test_verls_spelling_with_the_filter_is_the_generation_batch_and_without_it_the_training_batch():
    verl = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "data.gen_batch_size=12"]
    on = load_config(None, verl + ["algorithm.filter_groups.enable=True"])
    assert (on.data.train_batch_size, on.data.gen_batch_size, on.algorithm.dynamic_sampling) == (4, 12, True)
    off = load_config(None, verl)  # verl trains every prompt of its generation batch
    assert (off.data.train_batch_size, off.data.gen_batch_size, off.algorithm.dynamic_sampling) == (12, 0, False)
    off_given = load_config(None, verl + ["algorithm.filter_groups.enable=False"])
    assert (off_given.data.train_batch_size, off_given.data.gen_batch_size) == (12, 0)
    null = load_config(None, verl[:3] + ["data.gen_batch_size=null", "algorithm.filter_groups.enable=True"])
    assert (null.data.train_batch_size, null.data.draw_size) == (4, 4)


def test_a_run_draws_generation_batches_and_trains_the_training_batch(tiny_model_dir, tmp_path):
    # 64 problems, 12 drawn a round: the sampler's position after the step is 12 prompts a generation round
    over = overrides(tiny_model_dir, tmp_path, "gen", 1, 1) + ["algorithm.dynamic_sampling=true",
                                                                "data.gen_batch_size=12", "rollout.temperature=1.0"]
    assert train_grpo(load_config(None, over))["steps"] == 1
    run = tmp_path / "gen"
    row = [json.loads(x) for x in (run / "logs" / "metrics.jsonl").read_text().splitlines()][1]
    state = torch.load(run / "checkpoints" / "global_step_1" / "trainer_state.pt", weights_only=False)
    sampler = state["source"]["sampler"]
    assert sampler == {"epoch": 0, "offset": 12 * int(row["dapo/gen_rounds"])}
    assert row["dapo/kept_groups"] <= 4  # the training batch at most, never the 12 drawn
