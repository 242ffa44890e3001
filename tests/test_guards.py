"""The non-finite guard: rewards and costs checked at the reward boundary, user functions' failures as one
line, and through the command line (non-finite updates skipped and counted: test_guards_skipped_steps.py)."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from alignrl.rl.scoring import RewardStage
from alignrl.data.records import Sample
from alignrl.rewards.registry import ScoreError, finite_score, load_reward_fn, make_reward
from conftest import src_path

USER_FNS = """
import math
CALLS = 0

def misbehave(value):
    # each load of this file is its own module: the count is per loaded copy, so base evaluation
    # (its own copy) never reaches the threshold and the training reward does, at a known row
    global CALLS
    CALLS += 1
    if CALLS > int(THRESHOLD):
        if value == "raise":
            raise ZeroDivisionError("the user's bug\\nsecond line")
        return value
    return 0.0

THRESHOLD = 5
def raises(ds, s, gt, extra=None): return misbehave("raise")
def string(ds, s, gt, extra=None): return misbehave("0.5")
def none(ds, s, gt, extra=None): return misbehave(None)
def nan(ds, s, gt, extra=None): return misbehave(math.nan)
def raises_at_once(ds, s, gt, extra=None): raise KeyError("answer")
"""


def _user_file(tmp_path: Path, threshold: int = 5) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(USER_FNS.replace("THRESHOLD = 5", f"THRESHOLD = {threshold}"))
    return path


# --- the reward boundary ---------------------------------------------------------------------------

@pytest.mark.parametrize("value", [True, 3, 0.5, np.float32(0.25), np.int64(2), np.bool_(False)])
def test_finite_real_numbers_pass(value):
    assert finite_score(value, "f", "gsm8k") == float(value)
    assert finite_score({"score": value, "acc": 1.0}, "f", "gsm8k") == float(value)  # verl's dict return


def test_a_dict_without_a_score_is_a_one_line_error():
    with pytest.raises(ScoreError, match=r"returned a dict without a 'score' key \(keys \['acc'\]\)"):
        finite_score({"acc": 1.0}, "my_reward.py:score", "gsm8k")


@pytest.mark.parametrize("value, shown", [(math.nan, "returned nan"), (-math.inf, "returned -inf"),
                                          ("0.5", "returned a str ('0.5')"), (None, "returned None"),
                                          (np.float64("nan"), "returned nan"), (torch.tensor(1.0), "a Tensor")])
def test_other_values_are_one_line_errors(value, shown):
    with pytest.raises(ScoreError) as e:
        finite_score(value, "my_reward.py:score", "gsm8k")
    msg = str(e.value)
    assert "\n" not in msg and shown in msg and msg.startswith("reward function my_reward.py:score ")
    assert msg.endswith("(data_source gsm8k): return a finite float")


def test_user_function_is_wrapped(tmp_path):
    path = _user_file(tmp_path, threshold=0)
    with pytest.raises(ScoreError) as e:
        load_reward_fn(f"{path}:raises")("gsm8k", "text", "1")
    assert str(e.value) == (f"reward function {path}:raises raised ZeroDivisionError: the user's bug "
                            "(data_source gsm8k): fix it so that it returns a float (e.g. 0.0 for answers it "
                            "cannot score)")
    with pytest.raises(ScoreError, match="returned None"):  # the format bonus does not hide it
        make_reward(f"{path}:none", format_weight=0.5)("gsm8k", "#### 1", "1")


class _Tok:
    pad_token_id = 0

    def batch_decode(self, ids, skip_special_tokens=True):
        return [f"text {i}" for i in range(len(ids))]


def _rollout(b=4):
    from alignrl.data.records import Rollout

    z = torch.zeros(b, 2, dtype=torch.long)
    return Rollout(z, torch.ones(b, 2, dtype=torch.bool), z, torch.ones(b, 2, dtype=torch.bool),
                   torch.zeros(b, 2), torch.zeros(b, dtype=torch.bool), torch.arange(b) // 2)


SAMPLES = [Sample([], "1", "gsm8k"), Sample([], "2", "math")]


def test_reward_stage_names_function_row_and_data_source(tmp_path):
    path = _user_file(tmp_path, threshold=2)  # calls 3, 4 misbehave: rows 2 and 3 (the second prompt)
    fn = load_reward_fn(f"{path}:nan")
    stage = RewardStage(_Tok(), fn, fn, max_new_tokens=2)
    with pytest.raises(ScoreError) as e:
        stage.score(_rollout(), SAMPLES)
    assert str(e.value) == (f"reward function {path}:nan returned nan for row 2 (data_source math): "
                            "return a finite float")


def test_cost_function_and_models_are_checked(tmp_path):
    path = _user_file(tmp_path, threshold=0)
    ok = lambda *a: 1.0  # noqa: E731
    stage = RewardStage(_Tok(), ok, ok, max_new_tokens=2, cost_fn=load_reward_fn(f"{path}:string"))
    with pytest.raises(ScoreError, match=rf"^cost function {path}:string returned a str \('0.5'\) for row 0 "):
        stage.score(_rollout(), SAMPLES)

    class Scorer:
        name = "/models/rm"

        def score(self, *tensors):
            return torch.tensor([0.0, 1.0, 2.0, math.inf])

    stage = RewardStage(_Tok(), ok, ok, max_new_tokens=2, reward_model=Scorer())
    with pytest.raises(ScoreError) as e:
        stage.score(_rollout(), SAMPLES)
    assert str(e.value).startswith("reward model /models/rm scored inf for row 3 (data_source math): ")
    stage = RewardStage(_Tok(), ok, ok, max_new_tokens=2, cost_model=Scorer())
    with pytest.raises(ScoreError, match="^cost model /models/rm scored inf for row 3"):
        stage.score(_rollout(), SAMPLES)


# --- through the CLI -------------------------------------------------------------------------------

SMALL = ["data.train_size=64", "data.val_size=4", "data.val_size_during_training=2", "data.train_batch_size=4",
         "rollout.n=4", "rollout.max_new_tokens=8", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=4",
         "trainer.test_freq=2", "trainer.progress_bar=false", "trainer.logger=[jsonl]"]


def _argv(tiny_model_dir, tmp_path, *extra) -> list[str]:
    return ["train", "grpo", *SMALL, f"model.path={tiny_model_dir}", f"trainer.output_dir={tmp_path}",
            "trainer.experiment_name=run", *extra]


def _cli(tiny_model_dir, tmp_path, *extra, timeout=240):
    env = {**os.environ, "PYTHONPATH": src_path()}
    proc = subprocess.Popen([sys.executable, "-m", "alignrl", *_argv(tiny_model_dir, tmp_path, *extra)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, err


def _one_line(code, err):
    assert code == 2, err[-3000:]
    lines = [x for x in err.splitlines() if x.strip()]
    assert "Traceback" not in err and len(lines) == 1, err[-3000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("fn, says, process", [
    ("raises", "raised ZeroDivisionError: the user's bug for row 5 (data_source synthetic_arith): fix it", True),
    ("string", "returned a str ('0.5') for row 5 (data_source synthetic_arith): return a finite float", False),
    ("none", "returned None for row 5 (data_source synthetic_arith): return a finite float", False),
    ("nan", "returned nan for row 5 (data_source synthetic_arith): return a finite float", False),
    ("raises_at_once", "raised KeyError: 'answer' for row 0 (data_source synthetic_arith): fix it", False),  # base eval
])
def test_bad_reward_function_is_one_line_through_the_cli(fn, says, process, tiny_model_dir, tmp_path, cli_in_process):
    path = _user_file(tmp_path)
    extra = (f"algorithm.reward_fn={path}:{fn}", "trainer.total_training_steps=1", "trainer.save_freq=0")
    if process:
        code, _, err = _cli(tiny_model_dir, tmp_path, *extra)
    else:
        done = cli_in_process(*_argv(tiny_model_dir, tmp_path, *extra))
        code, err = done.returncode, done.stderr
    assert _one_line(code, err) == f"alignrl: error: reward function {path}:{fn} {says}" + (
        "" if fn in ("string", "none", "nan") else " so that it returns a float (e.g. 0.0 for answers it cannot "
                                                    "score)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's answer to trainer.device=cuda")
def test_cuda_asked_for_without_a_gpu_is_one_line(tiny_model_dir, tmp_path, cli_in_process):
    done = cli_in_process(*_argv(tiny_model_dir, tmp_path, "trainer.device=cuda", "trainer.total_training_steps=1"))
    assert _one_line(done.returncode, done.stderr).startswith(
        f"alignrl: error: trainer.device=cuda, but torch {torch.__version__} sees no CUDA device")
    assert not (tmp_path / "run" / "logs" / "metrics.jsonl").exists()  # nothing trained on the CPU instead


def test_more_ranks_than_gpus_is_one_line(monkeypatch):
    """Two ranks on a one-GPU node: rank 1 names the mismatch instead of CUDA's invalid-device-ordinal traceback."""
    from alignrl.config import ConfigError
    from alignrl.runtime.env import init_distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: pytest.fail(f"set_device({dev}) was called"))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"^rank 1 is local rank 1, but this node has 1 CUDA device\(s\): start at "
                                          r"most 1 rank\(s\) per node") as e:
        init_distributed()
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_nan_reward_run_stops_and_keeps_the_previous_checkpoint(tiny_model_dir, tmp_path):
    from alignrl.train.checkpoint import manifest_problem

    per_step = 4 * 4  # prompts × samples: the training reward's calls per RL step
    path = _user_file(tmp_path, threshold=2 * per_step)  # NaN from step 3 on
    code, out, err = _cli(tiny_model_dir, tmp_path, f"algorithm.reward_fn={path}:nan",
                          "trainer.total_training_steps=5", "trainer.save_freq=1")
    line = _one_line(code, err)
    assert line == (f"alignrl: error: reward function {path}:nan returned nan for row 0 "
                    "(data_source synthetic_arith): return a finite float")
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.glob("global_step_*")) == ["global_step_1", "global_step_2"]
    for step in (1, 2):
        assert manifest_problem(root / f"global_step_{step}") is None  # every file as the manifest lists it
        weights = load_file(root / f"global_step_{step}" / "model" / "model.safetensors")
        assert all(torch.isfinite(v).all() for v in weights.values())
    base = load_file(tiny_model_dir / "model.safetensors")
    assert any(not torch.equal(base[k], v) for k, v in weights.items()), "steps 1-2 trained"


@pytest.mark.timeout(240)
def test_kill_of_a_run_says_in_one_line_what_it_leaves(tiny_model_dir, tmp_path):
    """`kill PID` (SIGTERM) of `alignrl train` ended it with exit 143 and nothing said; it stops as Ctrl-C does,
    saying whether the same command resumes."""
    import signal

    env = {**os.environ, "PYTHONPATH": src_path(), "OMP_NUM_THREADS": "1"}
    argv = _argv(tiny_model_dir, tmp_path, "trainer.total_training_steps=100000", "trainer.save_freq=1")
    with subprocess.Popen([sys.executable, "-m", "alignrl", *argv], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            metrics = tmp_path / "run" / "logs" / "metrics.jsonl"
            deadline = time.time() + 180
            # the tracker stays (a global_step_N folder may already be rotated away when it is looked for)
            while not (tmp_path / "run" / "checkpoints" / "latest_checkpointed_iteration.txt").is_file():
                assert time.time() < deadline and proc.poll() is None, proc.stderr.read()[-3000:]
                time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            err = proc.communicate(timeout=60)[1]
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 143, err[-3000:]
    said = [x for x in err.splitlines() if "SIGTERM" in x]
    assert len(said) == 1 and said[0].startswith("alignrl: stopped by SIGTERM; the same command continues from ") \
        and "Traceback" not in err, err[-3000:]
    assert metrics.exists()


def test_metrics_rows_are_strict_json_with_null_for_a_non_finite_value(tmp_path):
    from alignrl.utils.tracking import Tracker, json_rows

    t = Tracker(tmp_path, ["jsonl"])
    t.log(1, {"actor/pg_loss": math.nan, "actor/grad_norm": math.inf, "reward/mean": 0.5})
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} is not JSON")) == {
        "step": 1, "actor/pg_loss": None, "actor/grad_norm": None, "reward/mean": 0.5}
    assert json_rows(line)[0]["reward/mean"] == 0.5
    assert Tracker(tmp_path, ["jsonl"], resume_step=1).history[0]["actor/pg_loss"] is None  # a resume keeps the row


def test_a_ctrl_c_swallowed_by_a_finalizer_prints_no_traceback(monkeypatch, capsys):
    """A Ctrl-C's KeyboardInterrupt raised inside a __del__ is printed by Python as "Exception ignored ...
    Traceback" after the rank's one line: once the rank knows it was interrupted, that one is kept quiet; any other
    exception in a finalizer is still printed."""
    import gc

    from alignrl.runtime import env

    class Raises:
        def __init__(self, exc: BaseException):
            self.exc = exc

        def __del__(self):
            raise self.exc

    monkeypatch.setattr(env, "_interrupted", True)
    monkeypatch.setattr(sys, "unraisablehook", env._quiet_lost_interrupt)
    Raises(KeyboardInterrupt())
    gc.collect()
    assert "Traceback" not in capsys.readouterr().err
    Raises(ValueError("a real problem"))
    gc.collect()
    assert "ValueError: a real problem" in capsys.readouterr().err
