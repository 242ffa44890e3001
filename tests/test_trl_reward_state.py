"""TRL's reward functions read the run's state (trainer_state) and log metrics (log_metric) and columns of the logged
generations (log_extra), as in TRL's trainer: scored by the producer, in the held-out evaluation, and in a run."""

import json
from types import SimpleNamespace

import pytest
import torch

from alignrl.config import load_config
from alignrl.data.records import Rollout, Sample
from alignrl.rewards.errors import ScoreError
from alignrl.rewards.registry import load_reward_fn
from alignrl.rewards.reward_log import TrainerState, logging_rewards
from alignrl.rl.evaluate import heldout_eval
from alignrl.rl.generation_logs import RolloutDump, records
from alignrl.rl.producer import RolloutMaker, merged_metrics
from alignrl.rl.scoring import RewardStage, logged_columns, rule_scores
from alignrl.runtime.env import SINGLE

FUNCTIONS = '''
import os

def curriculum(completions, trainer_state, log_metric, log_extra, **kwargs):
    with open(os.environ["SEEN"], "a") as f:
        f.write(repr(trainer_state) + "\\n")
    step = -1 if trainer_state is None else trainer_state.global_step
    log_metric("my/length", sum(len(c) for c in completions) / len(completions))
    log_metric("my/length", 0.0)  # logged twice in one call: the step's value is the mean
    log_extra("seen_step", [step] * len(completions))
    return [float(len(c)) for c in completions]

def text_metric(completions, log_metric, **kwargs):
    log_metric("my/bad", "high")
    return [1.0 for _ in completions]

def short_column(completions, log_extra, **kwargs):
    log_extra("note", ["x"])
    return [1.0 for _ in completions]

def odd_column(completions, log_extra, **kwargs):
    log_extra("note", [{(1, 2): "x"}] + [1] * (len(completions) - 1))
    return [1.0 for _ in completions]

def own_name(completions, log_metric, **kwargs):
    log_metric("reward/mean", 99.0)
    return [1.0 for _ in completions]
'''


class Tokenizer:
    """Each id is one letter: id k reads as chr(96 + k), 0 is padding."""

    pad_token_id = 0

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(chr(96 + int(i)) for i in row if int(i)) for row in ids]

    def decode(self, ids, skip_special_tokens=False):
        return self.batch_decode([ids])[0]


class Engine:
    """n answers a prompt, answer j of prompt p `j + 1` letters long."""

    def generate(self, prompts, params):
        outs = [[1] * (j + 1) for _ in prompts for j in range(params.n)]
        width = max(map(len, outs))
        ids = torch.tensor([o + [0] * (width - len(o)) for o in outs])
        return Rollout(torch.tensor([p for p in prompts for _ in range(params.n)]),
                       torch.ones(len(outs), 1, dtype=torch.bool), ids, ids > 0, torch.zeros(ids.shape),
                       torch.zeros(len(outs), dtype=torch.bool),
                       torch.arange(len(prompts)).repeat_interleave(params.n))


def _samples(n: int) -> list[Sample]:
    return [Sample(messages=[{"role": "user", "content": f"q{i}"}], ground_truth="1", data_source="d")
            for i in range(n)]


class Rows:
    """The producer's rows (`PromptData`'s shape): `samples`, and called with indices, (samples, prompt ids)."""

    def __init__(self, n: int):
        self.samples = _samples(n)

    def __call__(self, index):
        return [self.samples[i] for i in index], [[i + 1] for i in index]


@pytest.fixture
def functions(tmp_path, monkeypatch):
    (tmp_path / "rw.py").write_text(FUNCTIONS)
    monkeypatch.setenv("SEEN", str(tmp_path / "seen.txt"))
    return lambda name: load_reward_fn(f"trl:{tmp_path / 'rw.py'}:{name}")


def _seen(tmp_path) -> list[str]:
    return (tmp_path / "seen.txt").read_text().splitlines()


def test_the_producer_tells_the_step_and_keeps_the_metrics_and_columns(functions, tmp_path):
    fn = functions("curriculum")
    cfg = load_config(None, ["data.train_batch_size=2", "rollout.n=2", "trainer.total_training_steps=6",
                             "actor.ppo_mini_batch_size=2"])
    maker = RolloutMaker(cfg, Engine(), RewardStage(Tokenizer(), fn, fn, 8), ref=None)
    # the batch of RL step 2, made with the weights of one update: 8 rows, 2 a step, so 4 steps an epoch
    batch = maker.make(2, [3, 5], Rows(8), version=1)
    assert _seen(tmp_path) == [repr(TrainerState(global_step=1, max_steps=6, epoch=0.25))]
    assert batch.metrics["my/length"] == pytest.approx((1.5 + 0.0) / 2)  # answers of 1 and 2 letters
    assert batch.metrics["reward/mean"] == pytest.approx(1.5)
    assert logged_columns(batch.rollout) == [{"seen_step": 1}] * 4
    # the step's rollouts, as trainer.rollout_data_dir keeps them: verl's fields and the logged column
    train = Rows(8).samples
    RolloutDump(tmp_path / "dump", Tokenizer(), train, SINGLE)(2, batch)
    rows = [json.loads(line) for line in (tmp_path / "dump" / "2.jsonl").read_text().splitlines()]
    assert [r["seen_step"] for r in rows] == [1] * 4 and [r["output"] for r in rows] == ["a", "aa"] * 2
    assert all(r["step"] == 2 and r["score"] == len(r["output"]) for r in rows)
    # a ZeroMQ sampler's batch: the columns ride along to the trainer, which dumps the rollouts
    from alignrl.placements.zmq.batch_receiver import batch_of
    from alignrl.rl.scoring import plain_columns
    from alignrl.wire.frames import decode, encode
    from alignrl.wire.records import KIND, to_wire

    meta, tensors = to_wire(batch, Tokenizer(), lease="l", columns=plain_columns(batch.rollout))
    got = batch_of(decode(encode(KIND, meta, tensors)))
    assert logged_columns(got.rollout) == [{"seen_step": 1}] * 4 and got.metrics["my/length"] == pytest.approx(0.75)


def test_without_a_log_a_function_sees_no_state_and_logs_nowhere(functions, tmp_path):
    """Scored outside a producer or an evaluation (as in a timed rule's worker): None, and log calls do nothing."""
    assert rule_scores(functions("curriculum"), "reward function", _samples(2), ["a", "bb"]) == [1.0, 2.0]
    assert _seen(tmp_path) == ["None"]


def test_bad_logged_values_are_one_line_naming_the_function(functions):
    with logging_rewards(TrainerState()):
        with pytest.raises(ScoreError, match=r"^reward function .*rw.py:text_metric logged 'high' as metric 'my/bad' "
                                             r"\(log_metric\) for a batch of 2 rows"):
            rule_scores(functions("text_metric"), "reward function", _samples(2), ["a", "b"])
        with pytest.raises(ScoreError, match=r"rw.py:short_column logged 1 values in column 'note' \(log_extra\) "
                                             r"for 3 completions") as e:
            rule_scores(functions("short_column"), "reward function", _samples(3), ["a", "b", "c"])
    assert "\n" not in str(e.value)
    with logging_rewards(TrainerState()):
        with pytest.raises(ScoreError, match=r"rw.py:odd_column logged \{\(1, 2\): 'x'\} in column 'note' \(log_extra\)"
                                             r".*: log numbers, text, booleans or None"):
            rule_scores(functions("odd_column"), "reward function", _samples(2), ["a", "b"])


def test_a_metric_under_alignrls_own_name_is_one_line(functions):
    from alignrl.rewards.errors import RewardError

    fn = functions("own_name")
    cfg = load_config(None, ["data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2"])
    maker = RolloutMaker(cfg, Engine(), RewardStage(Tokenizer(), fn, fn, 8), ref=None)
    with pytest.raises(RewardError, match=r"logged 'reward/mean' \(log_metric\), a name of alignrl's own metrics"):
        maker.make(1, [0, 1], Rows(8))


def test_the_held_out_evaluation_tells_its_step_and_logs_its_metrics_and_columns(functions, tmp_path):
    engine = SimpleNamespace(generate=lambda prompts, params: Engine().generate(prompts, params))
    answers: list = []
    out = heldout_eval(engine, Tokenizer(), _samples(2), [[1], [2]], functions("curriculum"), 8, answers=answers,
                       state=TrainerState(global_step=4, max_steps=6, epoch=1.0))
    assert _seen(tmp_path) == [repr(TrainerState(4, 6, 1.0))]
    assert out["my/length"] == pytest.approx(0.5) and out["accuracy"] == 1.0
    logged = records(*zip(*answers), step=4)
    assert [r["seen_step"] for r in logged] == [4, 4] and logged[0]["step"] == 4


def test_a_metric_only_some_shares_logged_is_the_mean_of_those():
    parts = [({"reward/mean": 1.0, "my/x": 2.0}, 4), ({"reward/mean": 0.0}, 4), ({"reward/mean": 0.5, "my/x": 4.0}, 8)]
    merged = merged_metrics(parts)
    assert merged["my/x"] == pytest.approx((2.0 * 4 + 4.0 * 8) / 12)
    assert merged["reward/mean"] == pytest.approx(0.5)


def test_a_run_tells_its_functions_each_step_and_logs_what_they_log(functions, tiny_model_dir, tmp_path):
    from alignrl.runner import train_grpo
    from smallrun import overrides

    spec = f"trl:{tmp_path / 'rw.py'}:curriculum"
    over = overrides(tiny_model_dir, tmp_path, "trl", 2, 0) + [
        f"algorithm.reward_fn={spec}", f"trainer.rollout_data_dir={tmp_path / 'rollouts'}", "data.val_size=4",
        "data.val_size_during_training=4", "trainer.test_freq=0", "trainer.eval_pass_at_k=true"]
    train_grpo(load_config(None, over))
    # the base model's evaluation (greedy, then pass@k's greedy and sampled), steps 1 and 2, the final ones
    seen = _seen(tmp_path)
    assert seen == [repr(TrainerState(s, 2, s / 16)) for s in (0, 0, 0, 0, 1, 2, 2, 2)]
    metrics = [json.loads(line) for line in (tmp_path / "trl" / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = {m["step"]: m for m in metrics}
    assert "my/length" in steps[1] and "my/length" in steps[2]
    rows = [json.loads(line) for line in (tmp_path / "rollouts" / "2.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and {r["seen_step"] for r in rows} == {1}


def test_a_metric_some_ranks_logged_is_the_mean_of_theirs_on_every_rank(monkeypatch):
    """Two threads stand in for two ranks; rank 1's functions never logged my/x."""
    import threading

    from alignrl.rl import producer

    barrier, slots = threading.Barrier(2), {}

    def exchange(rank, value):
        slots[rank] = value
        barrier.wait()
        both = [slots[0], slots[1]]
        barrier.wait()  # both read before either writes the next round
        return both

    monkeypatch.setattr(producer, "gather_bytes", lambda env, blob: exchange(env.rank, blob))
    monkeypatch.setattr(producer, "all_reduce_sum", lambda env, xs: [a + b for a, b in zip(*exchange(env.rank, xs))])
    logged, out = [{"my/x": 2.0, "my/both": 1.0}, {"my/both": 3.0}], [None, None]

    def run(rank):
        out[rank] = producer.logged_over_ranks(SimpleNamespace(rank=rank), logged[rank])

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    assert out[0] == out[1] == {"my/both": 2.0, "my/x": 2.0}
