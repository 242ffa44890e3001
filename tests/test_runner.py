"""End-to-end GRPO runs on a tiny random model: outputs, resume after a kill, CLI errors."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alignrl.runner import train_grpo
from alignrl.config import ConfigError, load_config
from conftest import src_path

SMALL = ["data.train_size=64", "data.val_size=16", "data.val_size_during_training=8", "data.train_batch_size=4",
         "rollout.n=4", "rollout.max_new_tokens=8", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=4",
         "actor.lr=1e-3", "actor.lr_scheduler=cosine", "actor.kl_loss_coef=0.01", "trainer.test_freq=2",
         "trainer.progress_bar=false", "trainer.logger=[jsonl,tensorboard]"]


def _overrides(model_dir, out, name, steps, save_freq):
    return SMALL + [f"model.path={model_dir}", f"trainer.output_dir={out}", f"trainer.experiment_name={name}",
                    f"trainer.total_training_steps={steps}", f"trainer.save_freq={save_freq}"]


def _weights(run_dir: Path, step: int) -> dict:
    return load_file(run_dir / "checkpoints" / f"global_step_{step}" / "model" / "model.safetensors")


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
    assert done.returncode == 2 and "training data has 3 rows but data.train_batch_size=4" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"])
def test_other_estimators_run_a_step(estimator, tiny_model_dir, tmp_path):
    from alignrl.config import AlgorithmConfig
    from alignrl.core.advantages import ADVANTAGES

    choices = set(dict(AlgorithmConfig.__dataclass_fields__)["adv_estimator"].metadata["choices"])
    assert set(ADVANTAGES) == choices - {"gae"}  # gae takes the critic path
    cfg = load_config(None, _overrides(tiny_model_dir, tmp_path, estimator, 1, 0)
                      + [f"algorithm.adv_estimator={estimator}"])
    assert train_grpo(cfg)["steps"] == 1
    row = [json.loads(x) for x in (tmp_path / estimator / "logs" / "metrics.jsonl").read_text().splitlines()][1]
    assert all(math.isfinite(row[k]) for k in ("actor/grad_norm", "actor/clipfrac", "reward/mean"))


def test_outcome_token_rewards_sit_on_the_last_token():
    from alignrl.core.advantages import outcome_token_rewards

    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]]).float()
    out = outcome_token_rewards(torch.tensor([2.0, -1.0, 0.5]), mask)
    assert out.tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, -1.0], [0.5, 0.0, 0.0]]


def test_ppo_with_critic_checkpoints_and_resumes_the_critic(tiny_model_dir, tmp_path):
    over = _overrides(tiny_model_dir, tmp_path, "ppo", 2, 1) + ["algorithm.adv_estimator=gae", "critic.enable=true",
                                                                "critic.warmup_steps=1"]
    train_grpo(load_config(None, over))
    run = tmp_path / "ppo"
    rows = [json.loads(x) for x in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert "critic/vf_loss" in rows[1] and "actor/grad_norm" not in rows[1]  # step 1: critic warm-up only
    assert "actor/grad_norm" in rows[2] and "critic/vf_loss" in rows[2]
    assert (run / "checkpoints" / "global_step_2" / "critic" / "model.safetensors").is_file()
    assert (run / "checkpoints" / "global_step_2" / "critic_state" / "optim.pt").is_file()
    # one more step resumes actor and critic from step 2
    summary = train_grpo(load_config(None, over + ["trainer.total_training_steps=3"]))
    assert summary["steps"] == 3


def test_ppo_lagrangian_updates_the_multiplier(tiny_model_dir, tmp_path):
    cost = Path(__file__).parents[1] / "examples" / "length_cost.py"
    over = _overrides(tiny_model_dir, tmp_path, "safe", 2, 2) + [
        "algorithm.adv_estimator=gae", "critic.enable=true", f"safety.cost_fn={cost}:compute_score",
        "safety.cost_limit=0.0", "safety.lambda_lr=0.5"]
    train_grpo(load_config(None, over))
    rows = [json.loads(x) for x in (tmp_path / "safe" / "logs" / "metrics.jsonl").read_text().splitlines()]
    # log lambda += 0.5 * (J_c - 0) * lambda from 1, J_c the mean cost of every episode so far (the window holds
    # 128, the batches are equal): it follows the measured costs exactly
    log_lam, seen = 0.0, []
    for r in rows[1:]:
        seen.append(r["safety/cost_mean"])
        log_lam += 0.5 * (sum(seen) / len(seen)) * math.exp(log_lam)
        assert r["safety/lambda"] == pytest.approx(math.exp(log_lam))
        assert "cost_critic/vf_loss" in r
    state = torch.load(tmp_path / "safe" / "checkpoints" / "global_step_2" / "trainer_state.pt", weights_only=False)
    assert state["trainer"]["lagrangian"]["log_value"] == pytest.approx(log_lam)


@pytest.mark.parametrize("extra", [
    ["actor.policy_loss=gspo", "actor.loss_agg_mode=seq-mean-token-mean", "actor.clip_ratio_low=3e-4",
     "actor.clip_ratio_high=4e-4"],
    ["actor.policy_loss=cispo"],
    ["actor.clip_ratio_c=3.0", "actor.loss_agg_mode=seq-mean-token-sum-norm"],
    ["algorithm.dynamic_sampling=true", "algorithm.overlong_buffer_len=4", "algorithm.mask_truncated=true",
     "actor.recompute_old_logprobs=true", "algorithm.rollout_is=sequence", "algorithm.rollout_is_mode=mask"],
])
def test_policy_loss_variants_run_a_step(extra, tiny_model_dir, tmp_path):
    cfg = load_config(None, _overrides(tiny_model_dir, tmp_path, "v", 2, 0) + extra)
    assert train_grpo(cfg)["steps"] == 2
    rows = [json.loads(x) for x in (tmp_path / "v" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(v) for r in rows for v in r.values())


def test_ppo_lagrangian_with_a_cost_model(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1).save_pretrained(
        tmp_path / "cost_model")
    AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(tmp_path / "cost_model")
    over = _overrides(tiny_model_dir, tmp_path, "safe_model", 1, 0) + [
        "algorithm.adv_estimator=gae", "critic.enable=true", f"safety.cost_model={tmp_path / 'cost_model'}"]
    train_grpo(load_config(None, over))
    row = [json.loads(x) for x in (tmp_path / "safe_model" / "logs" / "metrics.jsonl").read_text().splitlines()][1]
    assert math.isfinite(row["safety/cost_mean"]) and row["safety/lambda"] >= 0.0


def test_remax_baseline_is_the_greedy_reward(tiny_model_dir, tmp_path):
    from alignrl.placements.local import place
    from alignrl.data.prompts import PromptData
    from alignrl.core.shaping import overlong_penalty
    from alignrl.data import synthetic
    from alignrl.interfaces import SamplingParams

    cfg = load_config(None, _overrides(tiny_model_dir, tmp_path, "remax", 1, 0) + ["algorithm.adv_estimator=remax"])
    placed = place(cfg, str(tiny_model_dir))
    maker = placed.maker
    samples, prompts = PromptData(placed.tokenizer, synthetic.generate("train", 3, seed=0), 64)(range(3))
    # reward = 1 for responses whose text length is odd: greedy and sampled responses then differ in reward
    maker.rewards.reward_fn = lambda ds, text, gt, extra=None: float(len(text) % 2)
    # DAPO's overlong penalty past 4 tokens: the baseline is shaped like the rewards it is taken from
    maker.rewards.overlong_buffer_len, maker.rewards.max_new_tokens = 4, 8
    ro = maker.engine.generate(prompts, maker.sampling_params(1))
    scored = maker.score(ro, samples)
    greedy = maker.engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=8))
    texts = placed.tokenizer.batch_decode(greedy.response_ids.masked_fill(~greedy.response_mask, 0),
                                          skip_special_tokens=True)
    penalty = overlong_penalty(greedy.response_lengths, 8, 4, 1.0)
    assert penalty.min() < 0  # some greedy response is long enough to be penalised
    expected = (torch.tensor([float(len(t) % 2) for t in texts]) + penalty)[ro.group]
    assert torch.equal(scored.baseline, expected)


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_plus_plus"])
def test_kl_in_reward_with_adaptive_controller(estimator, tiny_model_dir, tmp_path):
    over = _overrides(tiny_model_dir, tmp_path, "klr", 3, 3) + [
        f"algorithm.adv_estimator={estimator}", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl_type=adaptive",
        "algorithm.kl_coef=0.1", "algorithm.kl_target=0.01", "algorithm.kl_horizon=100", "actor.use_kl_loss=false"]
    train_grpo(load_config(None, over))
    rows = [json.loads(x) for x in (tmp_path / "klr" / "logs" / "metrics.jsonl").read_text().splitlines()][1:]
    coef = 0.1
    for r in rows:  # each step uses the current coefficient, then updates it from the measured KL
        assert r["actor/reward_kl_penalty_coeff"] == pytest.approx(coef)
        coef *= 1 + min(max(r["actor/reward_kl_penalty"] / 0.01 - 1, -0.2), 0.2) * 16 / 100
    state = torch.load(tmp_path / "klr" / "checkpoints" / "global_step_3" / "trainer_state.pt", weights_only=False)
    assert state["trainer"]["kl_ctrl"]["value"] == pytest.approx(coef)


def test_a_resume_may_turn_on_a_kl_penalty_but_not_change_the_placement(tiny_model_dir, tmp_path):
    """The KL controller of a run saved without one starts from its config; a checkpoint of the in-process loop
    resumed under pipeline.placement=zmq (whose data order is kept as leases) is one line, not a KeyError."""
    from alignrl.runtime.ports import free_ports

    train_grpo(load_config(None, _overrides(tiny_model_dir, tmp_path, "late", 2, 2)))
    on = _overrides(tiny_model_dir, tmp_path, "late", 3, 3) + [
        "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl_type=adaptive", "algorithm.kl_coef=0.1"]
    train_grpo(load_config(None, on))
    rows = [json.loads(x) for x in (tmp_path / "late" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[3]["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    ports = free_ports(2)
    zmq = _overrides(tiny_model_dir, tmp_path, "late", 4, 4) + [
        "pipeline.placement=zmq", f"pipeline.data_port={ports[0]}", f"pipeline.sync_port={ports[1]}"]
    with pytest.raises(ConfigError, match="was written under another pipeline.placement") as e:
        train_grpo(load_config(None, zmq))
    assert "\n" not in str(e.value)


def test_reward_model_folder_is_the_reward(tiny_model_dir, tmp_path):
    """algorithm.reward_model=DIR (an `alignrl train rm` folder): its scores are the rewards the loop trains on."""
    from transformers import AutoModelForSequenceClassification

    from alignrl.models.value import ModelScorer

    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1)
    rm.config.pad_token_id = rm.config.eos_token_id
    rm.save_pretrained(tmp_path / "rm")
    train_grpo(load_config(None, _overrides(tiny_model_dir, tmp_path, "rm_run", 1, 1)
                           + [f"algorithm.reward_model={tmp_path / 'rm'}"]))
    row = [json.loads(x) for x in (tmp_path / "rm_run" / "logs" / "metrics.jsonl").read_text().splitlines()][-1]
    assert row["reward/accuracy"] == 0.0  # the random policy never answers correctly by the rule...
    assert row["reward/std"] > 0  # ...yet its rewards vary: they are the model's scores
    assert ModelScorer(str(tmp_path / "rm")).model.config.num_labels == 1


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
    with pytest.raises(ConfigError, match=r"data.train_batch_size=4 × rollout.n=3 sequences must be a multiple of "
                                          r"actor.ppo_mini_batch_size=5"):
        load_config(None, ["data.train_batch_size=4", "rollout.n=3", "actor.ppo_mini_batch_size=5",
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
