"""Experience replay of prompt groups (pipeline.replay_buffer_size): the pure choice, the source around a batch
source, a short in-process run, the config checks and the ZeroMQ trainer flag."""

import dataclasses
import json

import pytest
import torch

from alignrl.compat.zmq_pipeline import parse_training, training_overrides
from alignrl.config import ConfigError, load_config
from alignrl.data.images import ImageRows, PromptImages
from alignrl.data.records import Rollout, ScoredBatch, Scores
from alignrl.rl.replay import (REPLAY_KEY, ReplaySource, check_replay, data_order_keys, group_reward_std,
                                 plan_replay, with_replay)


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
    state = src.state_dict()  # the data position, and the buffer beside it
    assert state["sampler"] == {"pos": 3} and data_order_keys(state) == {"sampler"}
    assert [len(g["tensors"]["rollout.group"]) for g in state[REPLAY_KEY]["ranks"][0]] == [2]
    src.close(True)
    assert inner.closed is True


def test_size_zero_hands_out_the_very_same_batches(tiny_cfg):
    inner = Listed([_batch([[0.0, 0.0]], 2, 1)])
    assert with_replay(inner, tiny_cfg, 0) is inner
    b = inner.batches[0]
    assert inner.next_batch(1) is b and b.metrics == {"reward/mean": 0.0}


def _same(a: ScoredBatch, b: ScoredBatch) -> None:
    """Every field of two batches equal, tensors by value, dtype and shape."""
    def eq(x, y, name):
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name

    for f in dataclasses.fields(Rollout):
        if f.name not in ("stats", "images"):
            eq(getattr(a.rollout, f.name), getattr(b.rollout, f.name), f.name)
    assert a.rollout.stats.keys() == b.rollout.stats.keys()
    for k in a.rollout.stats:
        eq(a.rollout.stats[k], b.rollout.stats[k], k)
    assert (a.rollout.images is None) == (b.rollout.images is None)
    if a.rollout.images is not None:
        for x, y in zip(a.rollout.images.rows, b.rollout.images.rows, strict=True):
            eq(x.pixel_values, y.pixel_values, "pixels")
            eq(x.image_grid_thw, y.image_grid_thw, "grid")
    for f in dataclasses.fields(Scores):
        eq(getattr(a.scores, f.name), getattr(b.scores, f.name), f.name)
    for name in ("loss_mask", "ref_logprobs", "prompt_index"):
        eq(getattr(a, name), getattr(b, name), name)
    assert (a.version, a.sampler_id, a.metrics) == (b.version, b.sampler_id, b.metrics)


def _batches() -> list[ScoredBatch]:
    """Six batches of three groups, of other widths, with images, costs and per-row stats: most groups have
    reward spread, some not, so the buffer fills, is drawn on and wraps around."""
    rewards = [[[0.0, 1.0], [1.0, 1.0], [0.2, 0.9]], [[0.0, 0.0], [1.0, 0.0], [0.5, 0.1]],
               [[0.3, 0.3], [0.0, 0.7], [0.4, 1.0]], [[1.0, 1.0], [0.0, 0.0], [0.6, 0.2]],
               [[0.1, 0.8], [0.0, 0.0], [0.9, 0.9]], [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]]
    out = []
    for i, r in enumerate(rewards):
        b = _batch(r, width=2 + i % 3, tag=i + 1, images=True)
        b.scores.costs = torch.arange(6, dtype=torch.float32) * (i + 1)
        b.rollout.stats = {"agent/turns": torch.full((6,), float(i))}
        out.append(b)
    return out


def test_a_buffer_restored_from_its_checkpointed_state_hands_out_the_same_batches(tmp_path):
    """state_dict -> a file (tensors and plain values: it loads with weights_only) -> a new source: the next
    batches are those the uninterrupted source hands out, field by field."""
    straight = ReplaySource(Listed(_batches()), capacity=3, pad_id=0, share=0.4)
    halted = ReplaySource(Listed(_batches()), capacity=3, pad_id=0, share=0.4)
    for step in (1, 2, 3):
        _same(straight.next_batch(step), halted.next_batch(step))
    torch.save(halted.state_dict(), tmp_path / "state.pt")
    resumed = ReplaySource(Listed(_batches()), capacity=3, pad_id=0, share=0.4)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert resumed.inner.loaded == {"sampler": {"pos": 3}}  # the inner source gets its own state alone
    assert len(resumed.buffer) == len(straight.buffer) > 0
    replaced = 0
    for step in (4, 5, 6):
        a, b = straight.next_batch(step), resumed.next_batch(step)
        _same(a, b)
        replaced += a.metrics["replay/groups_replaced"]
    assert replaced >= 3  # the restored groups were used
    # a smaller buffer on resume keeps the newest groups
    small = ReplaySource(Listed(_batches()), capacity=1, pad_id=0)
    small.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    _same(small.buffer[0][1], halted.buffer[-1][1])


def test_a_state_without_a_buffer_or_of_other_ranks_resumes_empty_and_a_damaged_one_is_one_line(capsys):
    from alignrl.train.checkpoint import CheckpointError

    src = ReplaySource(Listed(_batches()), capacity=3, pad_id=0)
    src.next_batch(1)
    src.load_state_dict({"sampler": {"pos": 1}})  # written with replay off
    assert len(src.buffer) == 0 and src.inner.loaded == {"sampler": {"pos": 1}}
    src.next_batch(1)
    state = src.state_dict()
    src.load_state_dict({**state, REPLAY_KEY: {"ranks": state[REPLAY_KEY]["ranks"] * 2}})
    assert len(src.buffer) == 0 and "holds the buffers of 2 rank(s), this run has 1" in capsys.readouterr().out
    del state[REPLAY_KEY]["ranks"][0][0]["tensors"]["rollout.prompt_ids"]
    with pytest.raises(CheckpointError, match="replay buffer is damaged") as e:
        src.load_state_dict(state)
    assert "\n" not in str(e.value) and len(src.buffer) == 0


def _ranks_share(rank: int, world: int, init: str) -> None:
    """One of two gloo ranks: each fills its buffer from batches of its own; the state holds both ranks' buffers in
    rank order, and each rank resumes with its own."""
    import torch.distributed as dist

    from alignrl.runtime.env import DistEnv
    from alignrl.rl.replay import group_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        def source(r: int) -> ReplaySource:
            inner = Listed(_batches()[r:r + 3])
            inner.env = DistEnv(rank=r, world_size=world, backend="gloo")
            return ReplaySource(inner, capacity=4, pad_id=0)

        mine = source(rank)
        for step in (1, 2, 3):
            mine.next_batch(step)
        state = mine.state_dict()  # collective
        assert len(state[REPLAY_KEY]["ranks"]) == world
        for r in range(world):  # what rank r holds, made here again from its batches
            other = source(r) if r != rank else mine
            if r != rank:
                for step in (1, 2, 3):
                    other.next_batch(step)
            saved = state[REPLAY_KEY]["ranks"][r]
            assert [g["std"] for g in saved] == [s for s, _ in other.buffer]
            for g, (std, group) in zip(saved, other.buffer, strict=True):
                want = group_state(std, group)
                assert g["tensors"].keys() == want["tensors"].keys()
                assert all(torch.equal(g["tensors"][k], v) for k, v in want["tensors"].items())
                assert {k: v for k, v in g.items() if k != "tensors"} == {k: v for k, v in want.items()
                                                                           if k != "tensors"}
        resumed = source(rank)
        resumed.load_state_dict(state)
        assert len(resumed.buffer) == len(mine.buffer) > 0
        for (a_std, a), (b_std, b) in zip(resumed.buffer, mine.buffer):
            assert a_std == b_std
            _same(a, b)
    finally:
        dist.destroy_process_group()


def test_each_rank_of_a_data_parallel_run_resumes_with_its_own_buffer(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_ranks_share, args=(2, f"file://{tmp_path / 'rendezvous'}"), nprocs=2, join=True)


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


REPLAY_ON = ["pipeline.replay_buffer_size=8", "pipeline.replay_share=0.5", "algorithm.rollout_is=token"]


def _grpo(model_dir, out, name: str, steps: int, *extra: str) -> dict:
    """A tiny in-process GRPO run under `out/name` with the length-parity reward; its summary."""
    from alignrl.runner import train_grpo  # here: the two-rank test's processes import this module quickly

    (out / "reward.py").write_text(REWARD)
    over = ["data.train_size=32", "data.val_size=4", "data.val_size_during_training=4", "data.train_batch_size=4",
            "rollout.n=4", "rollout.max_new_tokens=6", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=8",
            "trainer.test_freq=0", "trainer.progress_bar=false", "trainer.logger=[jsonl]",
            f"model.path={model_dir}", f"trainer.output_dir={out}", f"trainer.experiment_name={name}",
            f"trainer.total_training_steps={steps}", "trainer.save_freq=0",
            f"algorithm.reward_fn={out}/reward.py:compute_score", *extra]
    return train_grpo(load_config(None, over))


def _metrics(out, name: str) -> list[dict]:
    return [json.loads(x) for x in (out / name / "logs" / "metrics.jsonl").read_text().splitlines()]


def _final_weights(out, name: str, step: int) -> dict:
    from safetensors.torch import load_file

    return load_file(out / name / "checkpoints" / f"global_step_{step}" / "model" / "model.safetensors")


def _same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_two_step_grpo_run_with_replay_trains_and_logs_the_metrics(tiny_model_dir, tmp_path):
    assert _grpo(tiny_model_dir, tmp_path, "replay", 2, *REPLAY_ON)["steps"] == 2
    rows = _metrics(tmp_path, "replay")
    steps = [r for r in rows if "replay/buffer_size" in r]
    assert len(steps) == 2
    assert steps[0]["replay/groups_replaced"] == 0  # nothing stored before the first batch
    assert steps[0]["replay/buffer_size"] >= 1  # the length-parity reward has spread in some group
    assert steps[1]["replay/groups_replaced"] >= 1  # share 0.5 of 4 groups, from what step 1 stored
    assert "rollout/is_weight_mean" in steps[1]


def test_a_run_with_replay_resumed_from_its_checkpoint_ends_where_the_straight_run_does(tiny_model_dir, tmp_path):
    """Stopped after step 2 and resumed: step 3 replays the groups the checkpoint kept, so its metrics and the
    final weights are the straight run's, bit for bit."""
    _grpo(tiny_model_dir, tmp_path, "straight", 3, *REPLAY_ON)
    _grpo(tiny_model_dir, tmp_path, "halted", 2, *REPLAY_ON)
    state = torch.load(tmp_path / "halted" / "checkpoints" / "global_step_2" / "trainer_state.pt", weights_only=True)
    assert len(state["source"][REPLAY_KEY]["ranks"][0]) >= 1  # the buffer is in the checkpoint
    _grpo(tiny_model_dir, tmp_path, "halted", 3, *REPLAY_ON, "trainer.resume_mode=auto")
    _same_weights(_final_weights(tmp_path, "straight", 3), _final_weights(tmp_path, "halted", 3))
    a, b = _metrics(tmp_path, "straight"), _metrics(tmp_path, "halted")
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    assert a[3]["replay/groups_replaced"] >= 1  # step 3 draws on what steps 1-2 stored
    timing = ("timing/", "perf/")  # wall-clock measurements, the only things that differ
    assert {k: v for k, v in a[3].items() if not k.startswith(timing)} == \
        {k: v for k, v in b[3].items() if not k.startswith(timing)}


def test_a_buffer_of_size_zero_trains_the_very_same_weights_as_no_replay_key(tiny_model_dir, tmp_path):
    _grpo(tiny_model_dir, tmp_path, "plain", 2)
    _grpo(tiny_model_dir, tmp_path, "zero", 2, "pipeline.replay_buffer_size=0")
    _same_weights(_final_weights(tmp_path, "plain", 2), _final_weights(tmp_path, "zero", 2))
    assert not any(k.startswith("replay/") for r in _metrics(tmp_path, "zero") for k in r)


def test_replay_may_be_turned_on_and_off_across_a_resume(tiny_model_dir, tmp_path):
    _grpo(tiny_model_dir, tmp_path, "switch", 1)
    _grpo(tiny_model_dir, tmp_path, "switch", 2, *REPLAY_ON, "trainer.resume_mode=auto")
    _grpo(tiny_model_dir, tmp_path, "switch", 3, "trainer.resume_mode=auto")
    assert [r["step"] for r in _metrics(tmp_path, "switch")] == [0, 1, 2, 3]
    assert "replay/buffer_size" in _metrics(tmp_path, "switch")[2]


# The ZeroMQ trainer replaying groups of its sampler (training_worker.py --replay-buffer-size): test_pipeline_zmq's
# test_seed_workers_as_written.
