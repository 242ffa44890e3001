"""End-to-end GRPO runs on a tiny random model: outputs, resume after a kill, CLI errors."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from alignrl.runner import train_grpo
from alignrl.config import ConfigError, load_config
from conftest import src_path
from smallrun import overrides as _overrides, weights as _weights


def test_run_writes_layout_and_summary(tiny_model_dir, tmp_path):
    cfg = load_config(None, _overrides(tiny_model_dir, tmp_path, "run", 3, 2))
    summary = train_grpo(cfg)
    run = tmp_path / "run"
    assert (run / "config.yaml").is_file() and (run / "logs" / "curves.png").stat().st_size > 1000
    assert sorted(p.name for p in (run / "checkpoints").glob("global_step_*")) == ["global_step_2", "global_step_3"]
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "3"
    rows = [json.loads(x) for x in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for key in ("reward/mean", "reward/std", "reward/accuracy", "actor/kl_loss", "actor/entropy", "actor/clipfrac",
                "response/length_mean", "perf/tokens_per_s", "timing/gen", "timing/ref", "timing/train"):
        assert key in rows[1], key
    assert "val/accuracy" in rows[2] and list((run / "logs" / "tensorboard").glob("events.*"))
    saved = json.loads((run / "summary.json").read_text())
    assert saved == summary and saved["steps"] == 3 and {"base_accuracy", "final_accuracy", "wall_seconds"} <= set(saved)
    # the run trained: weights moved away from the base model
    base = load_file(tiny_model_dir / "model.safetensors")
    assert any(not torch.equal(base[k], v) for k, v in _weights(run, 3).items())


def _cli(*args, **kw):
    env = {**os.environ, "PYTHONPATH": src_path()}
    return subprocess.Popen([sys.executable, "-m", "alignrl", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_killed_run_resumes_to_identical_weights(tiny_model_dir, tmp_path, cli_in_process, device):
    """kill -9 of the CLI's process group after its first checkpoint; the resume runs the CLI in this process.
    On a GPU too: samples come from per-request seeded generators, so no global CUDA RNG state is needed."""
    steps = 6
    ref = train_grpo(load_config(None, _overrides(tiny_model_dir, tmp_path, "straight", steps, 2)
                                 + [f"trainer.device={device}"]))
    assert ref["steps"] == steps

    args = ["train", "grpo", *_overrides(tiny_model_dir, tmp_path, "killed", steps, 2), f"trainer.device={device}"]
    proc = _cli(*args, start_new_session=True)
    tracker = tmp_path / "killed" / "checkpoints" / "latest_checkpointed_iteration.txt"
    deadline = time.time() + 240
    while not tracker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    killed_at = int(tracker.read_text())
    assert killed_at < steps, "the run finished before it could be killed"
    # the launches before a resume count in the summary's wall_seconds, up to their checkpoint (here set to 1000 s)
    from alignrl.train.checkpoint import write_manifest

    at = tmp_path / "killed" / "checkpoints" / f"global_step_{killed_at}"
    state = torch.load(at / "trainer_state.pt", weights_only=False)
    assert state["wall_seconds"] > 0
    torch.save({**state, "wall_seconds": 1000.0}, at / "trainer_state.pt")
    write_manifest(at)

    resumed = cli_in_process(*args, "trainer.resume_mode=auto")
    assert resumed.returncode == 0, resumed.stderr
    assert f"(step {killed_at})" in resumed.stdout
    a, b = _weights(tmp_path / "straight", steps), _weights(tmp_path / "killed", steps)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    rows = [json.loads(x) for x in (tmp_path / "killed" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps + 1)), "each step logged exactly once"
    assert 1000 < json.loads((tmp_path / "killed" / "summary.json").read_text())["wall_seconds"] < 1300
    # a lower step target than the checkpoint's would train nothing and write over the summary: refused
    summary = (tmp_path / "straight" / "summary.json").read_text()
    with pytest.raises(ConfigError, match=f"global_step_{steps}, is past trainer.total_training_steps=2"):
        train_grpo(load_config(None, _overrides(tiny_model_dir, tmp_path, "straight", 2, 2)))
    assert (tmp_path / "straight" / "summary.json").read_text() == summary


@pytest.mark.parametrize("args, expected", [
    (["train", "grpo", "actor.lrr=1"], "unknown config key 'actor.lrr'"),
    (["train", "grpo", "rollout.n=many"], "bad value for 'rollout.n'"),
    (["train", "grpo", "rollout.n=0"], "rollout.n=0 is out of range"),
    (["train", "grpo", "--config", "/nonexistent.yaml"], "config file not found"),
    (["train", "grpo", "data.train_files=/nonexistent/train.parquet"], "data file not found"),
    (["train", "grpo", "model.path=/nonexistent/model"], "is not a Hugging Face model folder"),
])
def test_bad_input_gives_one_line_error(args, expected, tmp_path, cli_in_process):
    argv = [*args, f"trainer.output_dir={tmp_path}", "model.path=/nonexistent/model"
            if "model.path" not in " ".join(args) and "train_files" not in " ".join(args) else "trainer.seed=0"]
    if "=/nonexistent/" in args[-1]:  # these import torch first: through main() here (the config ones are quick)
        done = cli_in_process(*argv)
    else:
        out, err = (proc := _cli(*argv)).communicate(timeout=120)
        done = subprocess.CompletedProcess(argv, proc.returncode, out, err)
    assert done.returncode == 2, done.stderr
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in done.stderr, done.stderr


def _gsm8k_file(tmp_path, n):
    from alignrl.data import synthetic
    from alignrl.data.loaders import write_gsm8k_jsonl

    rows = [{"question": s.messages[-1]["content"], "answer": s.extra["answer"]}
            for s in synthetic.generate("train", n, seed=9)]
    path = tmp_path / "gsm8k.jsonl"
    write_gsm8k_jsonl(rows, path)
    return path


def test_runs_on_a_gsm8k_file(tiny_model_dir, tmp_path):
    data = _gsm8k_file(tmp_path, 12)
    cfg = load_config(None, _overrides(tiny_model_dir, tmp_path, "file", 1, 0)
                      + [f"data.train_files={data}", f"data.val_files={data}"])
    summary = train_grpo(cfg)
    assert summary["heldout_problems"] == 12 and summary["steps"] == 1


def test_too_little_data_is_a_one_line_error(tiny_model_dir, tmp_path, cli_in_process):
    data = _gsm8k_file(tmp_path, 3)
    done = cli_in_process("train", "grpo", *_overrides(tiny_model_dir, tmp_path, "small", 1, 0),
                          f"data.train_files={data}")
    assert done.returncode == 2 and "training data has 3 rows but a step draws 4 prompts" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_metrics_of_steps_trained_again_or_of_an_earlier_run_are_kept_aside(tmp_path):
    """A resume drops the rows past its checkpoint and a fresh start (trainer.resume_mode=disable) begins an
    empty metrics.jsonl; in both cases the file as it was is kept whole beside it, never lost."""
    import json

    from alignrl.utils.tracking import Tracker

    logs = tmp_path / "logs"
    first = Tracker(logs, ["jsonl"])
    for step in range(4):
        first.log(step, {"reward/mean": step / 10})
    first.close()
    old = (logs / "metrics.jsonl").read_text()
    Tracker(logs, ["jsonl"], resume_step=2).close()  # resumed from step 2: steps 3.. are trained again
    assert [json.loads(x)["step"] for x in (logs / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    Tracker(logs, ["jsonl"]).close()  # a fresh start
    assert (logs / "metrics.jsonl").read_text() == ""
    aside = sorted(p.read_text() for p in logs.glob("metrics.*.jsonl"))
    assert aside == sorted([old, "".join(old.splitlines(True)[:3])]), aside


def test_a_line_a_kill_left_torn_does_not_stop_the_resume_and_a_fresh_start_keeps_tensorboard_apart(tmp_path):
    """A run killed mid-append leaves half a line: the resume keeps every whole row up to its step and the torn
    file aside. A fresh start moves the earlier run's TensorBoard events aside (TensorBoard would draw the two
    runs as one curve); a resume keeps them (purge_step drops the steps trained again)."""
    import json

    from alignrl.utils.tracking import Tracker

    logs = tmp_path / "logs"
    first = Tracker(logs, ["jsonl", "tensorboard"])
    for step in range(4):
        first.log(step, {"reward/mean": step / 10})
    first.close()
    torn = (logs / "metrics.jsonl").read_text() + '{"step": 4, "reward/me'
    (logs / "metrics.jsonl").write_text(torn)
    Tracker(logs, ["jsonl", "tensorboard"], resume_step=3).close()
    assert [json.loads(x)["step"] for x in (logs / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    assert [p.read_text() for p in logs.glob("metrics.*.jsonl")] == [torn]
    assert not list(logs.glob("tensorboard.*"))
    Tracker(logs, ["jsonl", "tensorboard"]).close()
    assert [len(list(p.glob("events.*"))) for p in logs.glob("tensorboard.*")] == [2]  # the first run and its resume


def test_the_batch_line_counts_search_r1_mini_batches_in_sequences():
    """Search-R1's GRPO script: 512 prompts × n_agent 5, ppo_mini_batch_size 256 sequences: 10 updates a step."""
    from alignrl.runner import describe_batch
    from alignrl.config import load_config

    grpo = ["algorithm.adv_estimator=grpo", "data.train_batch_size=512", "actor_rollout_ref.actor.ppo_mini_batch_size=256",
            "actor_rollout_ref.actor.ppo_micro_batch_size=64", "actor_rollout_ref.rollout.n=1"]
    line = describe_batch(load_config(None, [*grpo, "actor_rollout_ref.rollout.n_agent=5"]), world=8)
    assert "2560 sequences/step; 10 mini-batch(es) of 256 sequences" in line
    from alignrl.placements.build import total_optimizer_steps

    search = load_config(None, [*grpo, "actor_rollout_ref.rollout.n_agent=5", "trainer.total_training_steps=100"])
    assert total_optimizer_steps(search) == 1000  # the lr schedule's length: 10 updates a step
    given = load_config(None, [*grpo, "actor_rollout_ref.rollout.n_agent=5", "actor.ppo_mini_batch_unit=prompts"])
    assert given.mini_batch_sequences == 1280  # the user's own choice stands
    verl = load_config(None, [*grpo[:-1], "actor_rollout_ref.rollout.n=4"])  # verl's own meaning: prompts
    assert verl.actor.ppo_mini_batch_unit == "prompts" and verl.mini_batch_sequences == 1024
    # a batch that is no multiple of the mini-batch ends in a smaller one, as verl splits it: 12 = 5 + 5 + 2
    ragged = load_config(None, ["data.train_batch_size=4", "rollout.n=3", "actor.ppo_mini_batch_size=5",
                                "actor.ppo_mini_batch_unit=sequences", "actor.ppo_micro_batch_size=5",
                                "trainer.total_training_steps=10"])
    assert ragged.mini_batches_per_step == 3 and total_optimizer_steps(ragged) == 30
    assert "2 mini-batch(es) of 5 sequences and one of 2" in describe_batch(ragged)
    with pytest.raises(ConfigError, match=r"data.train_batch_size=1 × rollout.n=3 sequences is smaller than one "
                                          r"mini-batch, actor.ppo_mini_batch_size=5"):
        load_config(None, ["data.train_batch_size=1", "rollout.n=3", "actor.ppo_mini_batch_size=5",
                           "actor.ppo_mini_batch_unit=sequences", "actor.ppo_micro_batch_size=5"])


def test_the_header_names_what_the_run_trains():
    from alignrl.runner import algorithm_name
    from alignrl.config import load_config

    assert algorithm_name(load_config(None, [])) == "GRPO"
    assert algorithm_name(load_config(None, ["algorithm.adv_estimator=rloo"])) == "RLOO"
    assert algorithm_name(load_config(None, ["algorithm.adv_estimator=gae", "critic.enable=true"])) == "PPO"
    assert algorithm_name(load_config(None, ["algorithm.adv_estimator=reinforce_plus_plus",
                                             "algorithm.outcome_baseline=loo"])) == "REINFORCE++ (loo baseline)"


def test_a_long_warning_stays_one_line_in_a_log_file():
    """Logs go to files and pipes, where rich would fold a line at 80 columns: a one-line warning must stay
    one line there (grep finds it whole)."""
    code = ("from alignrl.utils.tracking import console; "
            "console.print('[yellow]pipeline: ' + 'a long reason ' * 20 + '[/yellow]')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "80"}).stdout
    assert out.count("\n") == 1 and len(out) > 200, out


@pytest.mark.parametrize("layout", [[], ["actor.use_remove_padding=true"]])
def test_gradient_checkpointing_trains_the_same_weights(tiny_model_dir, tmp_path, layout):
    """actor.gradient_checkpointing (OpenRLHF's --gradient_checkpointing) recomputes each layer in the backward:
    the same gradients, so the same weights after a step, in the padded and in the packed forward (its
    attention stays routed through the packed function for the recomputation in the backward)."""
    over = lambda name, *extra: _overrides(tiny_model_dir, tmp_path, name, 1, 1) + [  # noqa: E731
        "trainer.test_freq=0", "trainer.logger=[jsonl]", "actor.entropy_coeff=0.01", *layout, *extra]
    train_grpo(load_config(None, over("plain")))  # the entropy bonus moves the weights whatever the rewards
    train_grpo(load_config(None, over("recompute", "actor.gradient_checkpointing=true")))
    a, b = _weights(tmp_path / "plain", 1), _weights(tmp_path / "recompute", 1)
    assert any(not torch.equal(a[k], v) for k, v in load_file(tiny_model_dir / "model.safetensors").items())
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


def test_the_saved_deepspeed_json_holds_the_runs_batch_and_names_what_it_does_not_follow(tmp_path, capsys):
    """DeepSpeed is handed nominal batch numbers (alignrl drives the accumulation): the run folder's copy holds the
    run's own, and a user's file whose numbers the run does not follow gets one line saying which and what to set."""
    from types import SimpleNamespace

    from alignrl.runner import save_ds_config
    from alignrl.runtime.env import DistEnv

    user = tmp_path / "z3.json"
    user.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                                "train_batch_size": 16, "zero_optimization": {"stage": 3}}))
    cfg = load_config(None, ["data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4",
                             "actor.ppo_micro_batch_size=8", f"trainer.deepspeed_config={user}"])
    trainer = SimpleNamespace(actor=SimpleNamespace(engine=SimpleNamespace(name="deepspeed", config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 2,
        "zero_optimization": {"stage": 3}})))
    save_ds_config(cfg, trainer, tmp_path, DistEnv(world_size=2))
    saved = json.loads((tmp_path / "deepspeed.json").read_text())
    assert (saved["train_batch_size"], saved["train_micro_batch_size_per_gpu"], saved["gradient_accumulation_steps"],
            saved["zero_optimization"]["stage"]) == (16, 8, 1, 3)  # 16 sequences an optimizer step, 8 per rank
    out = capsys.readouterr().out
    assert f"{user}: train_micro_batch_size_per_gpu 2, gradient_accumulation_steps 4 not followed" in out, out
    assert "actor.ppo_micro_batch_size" in out and out.count("\n") == 1
    (tmp_path / "z3.json").write_text(json.dumps({"train_batch_size": "auto", "zero_optimization": {"stage": 3}}))
    save_ds_config(cfg, trainer, tmp_path, DistEnv(world_size=2))
    assert capsys.readouterr().out == ""  # "auto" is the run's


def test_a_run_folder_that_cannot_be_made_is_one_line(tmp_path):
    """/proc/x (no such folder can exist there) ended in mkdir's FileNotFoundError traceback."""
    with pytest.raises(ConfigError, match=r"^cannot create the run folder /proc/x/r \(No such file or directory\): set "
                                          "trainer.output_dir to a folder this process can write$"):
        train_grpo(load_config(None, ["trainer.output_dir=/proc/x", "trainer.experiment_name=r"]))


def test_a_batch_that_is_no_multiple_of_the_mini_batch_trains_its_last_smaller_one(tiny_model_dir, tmp_path,
                                                                                   cli_in_process):
    """3 prompts × 2 samples = 6 sequences in mini-batches of 4: two optimizer steps, the second on 2 sequences, as
    verl's split gives them (its run_qwen3-1.7b.sh trains 1024 × 3 in mini-batches of 80 × 3)."""
    import torch

    from conftest import SMALL_GRPO, checkpoint_dir, run_settings

    got = cli_in_process("train", "grpo", *SMALL_GRPO, f"model.path={tiny_model_dir}", "data.train_batch_size=3",
                         "actor.ppo_mini_batch_size=4", "actor.ppo_mini_batch_unit=sequences",
                         "actor.ppo_micro_batch_size=2", *run_settings(tmp_path, "ragged", 2), "trainer.save_freq=2")
    assert got.returncode == 0, got.stderr[-3000:] + got.stdout[-3000:]
    assert "1 mini-batch(es) of 4 sequences and one of 2 × 1 epoch(s) = 2 optimizer steps/RL step" in got.stdout
    saved = torch.load(checkpoint_dir(tmp_path, "ragged", 2) / "model_state" / "optim.pt", weights_only=False)
    # two RL steps of two optimizer steps each, and the lr schedule stepped with them
    assert float(next(iter(saved["optimizer"]["state"].values()))["step"]) == 4.0
    assert saved["scheduler"]["last_epoch"] == 4
