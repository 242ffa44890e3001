"""What the policy wrote, kept as verl keeps it: trainer.rollout_data_dir (each step's rollouts),
trainer.validation_data_dir (each evaluation's answers) as <step>.jsonl, and trainer.log_val_generations (a few
held-out answers at each evaluation, the same problems each time, in the logs, TensorBoard and a wandb table)."""

import json

import pytest

from alignrl.config import load_config
from alignrl.rl.generation_logs import chosen_generations
from alignrl.runner import train_grpo
from alignrl.utils.tracking import Tracker
from smallrun import overrides


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_run_keeps_its_rollouts_and_held_out_answers(tiny_model_dir, tmp_path):
    rollouts, answers = tmp_path / "rollouts", tmp_path / "answers"
    over = overrides(tiny_model_dir, tmp_path, "dumps", 2, 0) + [
        f"trainer.rollout_data_dir={rollouts}", f"trainer.validation_data_dir={answers}",
        "trainer.log_val_generations=3", "trainer.test_freq=1", "rollout.temperature=1.0"]
    train_grpo(load_config(None, over))
    metrics = _lines(tmp_path / "dumps" / "logs" / "metrics.jsonl")
    for step in (1, 2):  # 4 prompts x 4 answers a step, verl's fields; their scores are the step's rewards
        rows = _lines(rollouts / f"{step}.jsonl")
        assert len(rows) == 16 and {tuple(sorted(r)) for r in rows} == {("gts", "input", "output", "score", "step")}
        assert all(r["step"] == step and r["input"] and r["gts"] for r in rows)
        assert sum(r["score"] for r in rows) / 16 == pytest.approx(metrics[step]["reward/mean"])
    assert len({r["input"] for r in _lines(rollouts / "1.jsonl")}) == 4
    # the base model's answers to all 16 held-out problems, 8 at step 1, then the final evaluation's 16 at step 2
    assert [len(_lines(answers / f"{s}.jsonl")) for s in (0, 1, 2)] == [16, 8, 16]
    base = _lines(answers / "0.jsonl")
    assert all(r["score"] in (0.0, 1.0) and r["step"] == 0 for r in base)
    logged = _lines(tmp_path / "dumps" / "logs" / "val_generations.jsonl")
    assert [x["step"] for x in logged] == [0, 1, 2, 2] and all(len(x["generations"]) == 3 for x in logged)
    assert logged[0]["generations"] == chosen_generations(base, 3)  # chosen as verl chooses: the same problems
    assert {g["input"] for g in logged[2]["generations"]} == {g["input"] for g in logged[1]["generations"]}


def test_the_table_grows_a_row_an_evaluation_in_wandb_and_is_text_in_tensorboard(tmp_path):
    logged = []

    class Run:  # the wandb run's log, recorded
        def log(self, row):
            logged.append(row)

    tracker = Tracker(tmp_path / "logs", ["tensorboard"])
    tracker.wandb = Run()
    tracker.log_table("val/generations", 0, [["1+1=", "2", 1.0], ["2+2=", "5", 0.0]])
    tracker.log_table("val/generations", 5, [["1+1=", "3", 0.0], ["2+2=", "4", 1.0]])
    table = logged[-1]["val/generations"]
    assert table.columns == ["step", "input_1", "output_1", "score_1", "input_2", "output_2", "score_2"]
    assert table.data == [[0, "1+1=", "2", 1.0, "2+2=", "5", 0.0], [5, "1+1=", "3", 0.0, "2+2=", "4", 1.0]]
    tracker.wandb = None
    tracker.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "logs" / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    texts = events.Tensors("val/generations/text_summary")
    assert [t.step for t in texts] == [0, 5] and b"2+2=" in texts[1].tensor_proto.string_val[0]


def test_verls_keys_pass_through():
    cfg = load_config(None, ["actor_rollout_ref.rollout.n=2", "trainer.log_val_generations=10",
                             "trainer.rollout_data_dir=null", "trainer.validation_data_dir=/tmp/val"])
    t = cfg.trainer
    assert (t.log_val_generations, t.rollout_data_dir, t.validation_data_dir) == (10, None, "/tmp/val")
