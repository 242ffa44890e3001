"""Experience replay of prompt groups (pipeline.replay_buffer_size): the pure choice, the source around a batch
source, a short in-process run, the config checks and the ZeroMQ trainer flag."""

import json

import pytest
import torch

from alignrl.compat.zmq_pipeline import parse_training, training_overrides
from alignrl.config import ConfigError, load_config
from alignrl.data.images import ImageRows, PromptImages
from alignrl.data.records import Rollout, ScoredBatch, Scores
from alignrl.rl.replay import ReplaySource, check_replay, group_reward_std, plan_replay, with_replay
from alignrl.runner import train_grpo


def test_plan_replaces_flat_groups_with_the_highest_spread_stored_ones():
    plan = plan_replay([0.0, 0.5, 0.0, 0.2], [0.3, 0.9, 0.3, 0.1])
    assert plan.replace == [0, 2]
    assert plan.use == [1, 2]  # 0.9, then the newer of the two 0.3s
    assert plan.store == [1, 3]


def test_plan_with_a_share_replaces_the_lowest_spread_groups_too():
    plan = plan_replay([0.4, 0.0, 0.1, 0.3], [0.5, 0.6, 0.7], share=0.5)
    assert plan.replace == [1, 2] and plan.use == [2, 1]


def test_plan_uses_no_more_than_the_buffer_holds_and_nothing_from_an_empty_one():
    assert plan_replay([0.0, 0.0, 0.0], [0.2]).replace in ([0], [1], [2])
    empty = plan_replay([0.0, 1.0], [])
    assert empty.replace == [] and empty.use == [] and empty.store == [1]


def test_group_reward_std_is_exactly_zero_for_equal_rewards():
    std = group_reward_std(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.3, 0.3]), torch.tensor([0, 0, 1, 1, 2, 2]))
    assert std[0] == 0.0 and std[2] == 0.0 and std[1] == pytest.approx(0.5)


def _batch(rewards: list[list[float]], width: int, tag: int, images: bool = False) -> ScoredBatch:
    """A hand-made batch: one group per inner list, responses `width` wide, token ids and log-probs = `tag`."""
    rows = sum(len(r) for r in rewards)
    group = torch.tensor([g for g, r in enumerate(rewards) for _ in r])
    img = PromptImages(torch.full((2, 3), float(tag)), torch.tensor([[1, 1, 2]]))
    ro = Rollout(prompt_ids=torch.full((rows, 3), tag), prompt_mask=torch.ones(rows, 3, dtype=torch.bool),
                 response_ids=torch.full((rows, width), tag), response_mask=torch.ones(rows, width, dtype=torch.bool),
                 logprobs=torch.full((rows, width), -float(tag)), truncated=torch.zeros(rows, dtype=torch.bool),
                 group=group, images=ImageRows([img] * rows) if images else None)
    flat = torch.tensor([x for r in rewards for x in r])
    return ScoredBatch(ro, Scores(flat, flat > 0.5), torch.ones(rows, width, dtype=torch.bool),
                       torch.full((rows, width), -0.5), group + 10 * tag, version=tag, metrics={"reward/mean": 0.0})


class Listed:
    """A BatchSource handing out prepared batches."""

    def __init__(self, batches):
        self.batches, self.closed = list(batches), None

    def next_batch(self, step):
        return self.batches[step - 1]

    def state_dict(self):
        return {"sampler": {"pos": 3}}

    def load_state_dict(self, state):
        self.loaded = state

    def close(self, finished):
        self.closed = finished


def test_source_replays_stored_groups_in_place_of_flat_ones_keeping_size_and_images():
    first = _batch([[0.0, 1.0], [1.0, 1.0]], width=2, tag=1, images=True)
    second = _batch([[0.0, 0.0], [1.0, 0.0]], width=4, tag=2, images=True)
    inner = Listed([first, second])
    src = ReplaySource(inner, capacity=4, pad_id=0)
    out1 = src.next_batch(1)
    assert out1.metrics["replay/groups_replaced"] == 0 and out1.metrics["replay/buffer_size"] == 1
    out2 = src.next_batch(2)
    assert len(out2) == len(second) and out2.metrics["replay/groups_replaced"] == 1
    assert out2.metrics["replay/buffer_size"] == 1  # batch 1's group used up, batch 2's group 1 stored
    # batch 2's group 1 first, then batch 1's group 0 (narrower: padded on the right)
    assert out2.rollout.group.tolist() == [0, 0, 1, 1]
    assert out2.prompt_index.tolist() == [21, 21, 10, 10]
    assert out2.scores.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert out2.rollout.logprobs[2:].tolist() == [[-1.0, -1.0, 0.0, 0.0]] * 2  # the rollout's own, for the IS
    assert out2.loss_mask[2:].tolist() == [[True, True, False, False]] * 2
    assert out2.ref_logprobs.shape == (4, 4)
    assert [float(r.pixel_values[0, 0]) for r in out2.rollout.images.rows] == [2.0, 2.0, 1.0, 1.0]
    assert out2.version == 2
    assert src.state_dict() == {"sampler": {"pos": 3}}  # the data position alone: the buffer is not checkpointed
    src.close(True)
    assert inner.closed is True


def test_size_zero_hands_out_the_very_same_batches(tiny_cfg):
    inner = Listed([_batch([[0.0, 0.0]], 2, 1)])
    assert with_replay(inner, tiny_cfg, 0) is inner
    b = inner.batches[0]
    assert inner.next_batch(1) is b and b.metrics == {"reward/mean": 0.0}


@pytest.fixture
def tiny_cfg():
    return load_config(None, [])


@pytest.mark.parametrize("over, words", [
    (["pipeline.replay_buffer_size=8"], "algorithm.rollout_is=token"),
    (["pipeline.replay_buffer_size=8", "algorithm.rollout_is=token", "actor.recompute_old_logprobs=false"],
     "recompute_old_logprobs"),
    (["pipeline.replay_share=0.5"], "pipeline.replay_buffer_size"),
])
def test_replay_without_its_correction_is_refused_in_one_line(over, words):
    try:
        cfg = load_config(None, over)
    except ConfigError as e:  # a combination the config checks refuse already
        assert words in str(e) and "\n" not in str(e)
        return
    with pytest.raises(ConfigError, match=words) as e:
        check_replay(cfg)
    assert "\n" not in str(e.value)


def test_replay_flag_of_the_zmq_trainer_sets_the_key_and_its_correction():
    a, extra = parse_training(["--replay-buffer-size", "16", "--no-deepspeed"])
    o = training_overrides(a, extra)
    assert "pipeline.replay_buffer_size=16" in o and "algorithm.rollout_is=token" in o
    cfg = load_config(None, o)
    assert cfg.pipeline.replay_buffer_size == 16 and cfg.algorithm.rollout_is == "token"
    check_replay(cfg)  # the flag alone makes a setting the trainer accepts
    a, extra = parse_training(["--replay-buffer-size", "16", "algorithm.rollout_is=sequence"])
    o = training_overrides(a, extra)
    assert "algorithm.rollout_is=token" not in o and o[-1] == "algorithm.rollout_is=sequence"
    a, extra = parse_training([])
    assert not any(x.startswith("pipeline.replay") for x in training_overrides(a, extra))


REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 2)  # a reward with spread inside most groups, whatever the model says
'''


def test_two_step_grpo_run_with_replay_trains_and_logs_the_metrics(tiny_model_dir, tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    over = ["data.train_size=32", "data.val_size=4", "data.val_size_during_training=4", "data.train_batch_size=4",
            "rollout.n=4", "rollout.max_new_tokens=6", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=8",
            "trainer.test_freq=0", "trainer.progress_bar=false", "trainer.logger=[jsonl]",
            f"model.path={tiny_model_dir}", f"trainer.output_dir={tmp_path}", "trainer.experiment_name=replay",
            "trainer.total_training_steps=2", "trainer.save_freq=0",
            f"algorithm.reward_fn={tmp_path}/reward.py:compute_score",
            "pipeline.replay_buffer_size=8", "pipeline.replay_share=0.5", "algorithm.rollout_is=token"]
    assert train_grpo(load_config(None, over))["steps"] == 2
    rows = [json.loads(x) for x in (tmp_path / "replay" / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "replay/buffer_size" in r]
    assert len(steps) == 2
    assert steps[0]["replay/groups_replaced"] == 0  # nothing stored before the first batch
    assert steps[0]["replay/buffer_size"] >= 1  # the length-parity reward has spread in some group
    assert steps[1]["replay/groups_replaced"] >= 1  # share 0.5 of 4 groups, from what step 1 stored
    assert "rollout/is_weight_mean" in steps[1]


@pytest.mark.timeout(400)
def test_zmq_trainer_replays_groups_of_its_samplers(tiny_model_dir, tmp_path):
    """The ZeroMQ placement: the trainer's replay source wraps the batches its sampler sends."""
    from alignrl.runtime.ports import free_ports
    from test_pipeline_zmq import finish, overrides, sampler, spawn

    (tmp_path / "reward.py").write_text(REWARD)
    ports = free_ports(2)
    trainer = spawn("train", "grpo", *overrides(tiny_model_dir, tmp_path, "zmq", 2, ports, "pipeline.placement=zmq",
                                                 "pipeline.peer_timeout_s=120", "pipeline.replay_buffer_size=8",
                                                 "pipeline.replay_share=0.5", "algorithm.rollout_is=token",
                                                 f"algorithm.reward_fn={tmp_path}/reward.py:compute_score"))
    out, _ = finish(trainer, sampler(tiny_model_dir, ports))
    assert "replay buffer:" in out
    rows = [json.loads(x) for x in (tmp_path / "zmq" / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "replay/buffer_size" in r]
    assert len(steps) == 2 and steps[0]["replay/buffer_size"] >= 1 and steps[1]["replay/groups_replaced"] >= 1
