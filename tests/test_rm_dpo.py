"""Reward/cost-model and DPO training end to end on the tiny test model: in process, and as seed 002's
commands under torchrun with two gloo ranks."""

import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_group
from alignrl.preference import rm
from alignrl.preference.cli import dpo_main, rm_main

REPO = Path(__file__).resolve().parents[1]
SMALL = ["max_eval_pairs=24", "batch_size=8", "eval_batch_size=24", "log_every=2", "report_to=[jsonl]"]


def _rm(tmp: Path, model: Path, task: str, *extra: str) -> dict:
    out = tmp / f"{task}_rm"
    rc = rm_main(["--config", str(REPO / "configs/rm_config.yaml"), "--task", task, "--output_dir", str(out),
                  "--logging_dir", str(tmp / f"logs_{task}"), f"model_path={model}", "max_train_pairs=96", "epochs=2",
                  "learning_rate=2e-3", *SMALL, *extra])
    assert rc == 0
    return json.loads((out / "eval_results.json").read_text())


@pytest.fixture(scope="module")
def scorers(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rms")
    return tmp, _rm(tmp, tiny_model_dir, "helpful"), _rm(tmp, tiny_model_dir, "harmless")


def test_reward_and_cost_models_train_save_and_load_as_scorers(scorers):
    from transformers import AutoTokenizer

    from alignrl.config import load_config
    from alignrl.data.preference import collate_pairs, encode_pairs, load_pairs
    from alignrl.models.value import ModelScorer

    tmp, helpful, harmless = scorers
    assert helpful["model_type"] == "reward" and harmless["model_type"] == "cost"
    assert helpful["eval_pairs"] == harmless["eval_pairs"] == 24
    assert helpful["eval_accuracy"] >= 0.75 and helpful["eval_accuracy"] > helpful["eval_accuracy_before"]
    assert harmless["eval_accuracy"] >= 0.8 and harmless["eval_sign_accuracy"] >= 0.7
    assert json.loads((tmp / "harmless_rm" / rm.SCORE_INFO).read_text())["model_type"] == "cost"
    # the RL loop's PPO-Lagrangian takes the folder as safety.cost_model and scores rollouts with ModelScorer
    cfg = load_config(None, [f"safety.cost_model={tmp / 'harmless_rm'}", "algorithm.adv_estimator=gae",
                             "critic.enable=true"])
    scorer = ModelScorer(cfg.safety.cost_model)
    pairs = load_pairs("builtin:harmless_test", "safer", limit=24)
    tok = AutoTokenizer.from_pretrained(cfg.safety.cost_model)
    b = collate_pairs(encode_pairs(tok, pairs, 256)[0], pairs, tok.pad_token_id)
    cost = scorer.score(b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)
    acc = float((cost[24:] > cost[:24]).float().mean())
    assert acc == pytest.approx(harmless["eval_accuracy"], abs=1e-6)  # the trainer's reading = ModelScorer's
    # the trainer's scorer and ModelScorer read the same position with the same weights
    wrapped = rm.LastTokenScorer(scorer.model)
    same = wrapped(torch.cat([b.prompt_ids, b.response_ids], 1), torch.cat([b.prompt_mask, b.response_mask], 1))
    assert torch.allclose(same, cost, atol=1e-5)
    # the saved config holds the held-out scores' mean and std (OpenRLHF's), which a normalizing run divides by
    config = json.loads((tmp / "harmless_rm" / "config.json").read_text())
    assert config["mean"] == pytest.approx(float(cost.mean()), abs=1e-4)
    assert config["std"] == pytest.approx(float(cost.std()), abs=1e-4)
    normalized = ModelScorer(cfg.safety.cost_model, normalize=True).score(b.prompt_ids, b.prompt_mask, b.response_ids,
                                                                          b.response_mask)
    assert torch.allclose(normalized, (cost - config["mean"]) / config["std"], atol=1e-5)
    assert float(normalized.mean()) == pytest.approx(0.0, abs=1e-3)


def _dpo(tmp: Path, model: Path, name: str, *extra: str) -> dict:
    out = tmp / name
    rc = dpo_main(["--config", str(REPO / "configs/dpo_config.yaml"), "--output_dir", str(out),
                   "--logging_dir", str(tmp / f"logs_{name}"), f"model_path={model}", "max_train_pairs=48",
                   "learning_rate=2e-3", "batch_size=4", "gradient_accumulation_steps=2", "gradient_checkpointing=false",
                   *SMALL[:1], "eval_batch_size=24", "log_every=2", "report_to=[jsonl]", *extra])
    assert rc == 0
    return json.loads((out / "eval_results.json").read_text())


@pytest.mark.slow
def test_dpo_raises_heldout_reward_accuracy_and_precompute_matches(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    live = _dpo(tmp_path, tiny_model_dir, "live", "loss_type=sigmoid")
    pre = _dpo(tmp_path, tiny_model_dir, "pre", "loss_type=sigmoid", "gradient_checkpointing=true",
               "--precompute_ref_log_probs")
    b, a = live["before"]["all"], live["after"]["all"]
    assert b["reward_accuracy"] == 0.5 and b["reward_margin"] == 0.0  # policy == reference: every reward is 0
    assert a["reward_accuracy"] > 0.7 and a["reward_margin"] > 0
    assert set(live["after"]) == {"all", "helpful_test", "harmless_test"} and a["pairs"] == 48
    # a precomputed reference (and checkpointed activations) change nothing but the cost
    for k in ("reward_accuracy", "reward_margin", "logp_accuracy"):
        assert pre["after"]["all"][k] == pytest.approx(a[k], abs=1e-4)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "live"))
    assert model.config.model_type == "qwen2"
    steps = [json.loads(line) for line in (tmp_path / "logs_live" / "metrics.jsonl").read_text().splitlines()]
    assert steps[0]["step"] == 2 and "rewards/accuracy" in steps[0]


@pytest.mark.slow
def test_safe_dpo_with_trained_scorers(scorers, tiny_model_dir, tmp_path):
    rms, _, _ = scorers
    res = _dpo(tmp_path, tiny_model_dir, "safe", "loss_type=safe", f"helpful_rm={rms / 'helpful_rm'}",
               f"harmless_rm={rms / 'harmless_rm'}", "offset_alpha=0.5")
    assert res["loss_type"] == "safe_odpo" and res["harmless_rm"].endswith("harmless_rm")
    assert res["after"]["all"]["reward_accuracy"] > 0.6
    steps = [json.loads(line) for line in (tmp_path / "logs_safe" / "metrics.jsonl").read_text().splitlines()]
    assert all(s["safe/offset"] > 0 for s in steps if "safe/offset" in s)
    assert any("safe/swapped_frac" in s for s in steps)


# ---------------------------------------------------------------- seed 002's commands, two gloo ranks


def _seed_root(tmp: Path) -> Path:
    """A copy of the repository's entry points (configs, scripts, src) in which the seed commands run as
    written, so their default output folders (models/, logs/) land in tmp."""
    root = tmp / "repo"
    root.mkdir()
    for name in ("configs", "scripts", "src"):
        (root / name).symlink_to(REPO / name)
    return root


def _run(cmd: list[str], root: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "ALIGNRL_DIST_TIMEOUT": "120"}
    env.pop("WORLD_SIZE", None)
    p = run_group(cmd, timeout, cwd=root, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


@pytest.mark.slow
def test_seed_002_commands_two_ranks(scorers, tiny_model_dir, tmp_path, monkeypatch):
    from alignrl.runtime.ports import free_port

    if not shutil.which("bash"):
        pytest.skip("no bash")
    root = _seed_root(tmp_path)
    small = [f"model_path={tiny_model_dir}", "max_train_pairs=64", "max_eval_pairs=24", "eval_batch_size=24",
             "learning_rate=2e-3", "epochs=1", "report_to=[jsonl]", "batch_size=4"]
    # the seed's script with an override passed through: FSDP2 (DDP trains the DPO ranks below, DeepSpeed the
    # reward model of test_reward_model_on_deepspeed_two_ranks)
    p = _run(["bash", "scripts/train_rm_distributed.sh", "helpful", "2", *small, "strategy=fsdp2"], root)
    assert "effective batch = per-device batch × world size × gradient accumulation = 4 × 2 × 1 = 8" in p.stdout
    assert p.stdout.count("held-out pairwise accuracy before training") == 1  # rank 0 prints, rank 1 does not
    two = json.loads((root / "models/helpful_rm/eval_results.json").read_text())
    assert two["world_size"] == 2 and two["steps"] == 8 and (root / "logs/training/helpful_rm/metrics.jsonl").is_file()
    assert two["strategy"] == "fsdp2", two
    # held-out pairs sharded over two ranks and summed give the one-process number (same seeded head)
    assert two["eval_accuracy_before"] == scorers[1]["eval_accuracy_before"]
    assert _complete_scorer(root / "models/helpful_rm")
    # the single-process fallback, `python -m src.training.train_rm ...` from the root (run in this process)
    monkeypatch.chdir(root)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(sys, "argv", ["train_rm", "--config", "configs/rm_config.yaml", "--task", "harmless",
                                      "--output_dir", "models/harmless_rm", *small])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("src.training.train_rm", run_name="__main__")
    assert done.value.code == 0
    one = json.loads((root / "models/harmless_rm/eval_results.json").read_text())
    assert one["world_size"] == 1 and one["model_type"] == "cost" and one["steps"] == 16
    p = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
              "-m", "src.training.train_safe_mm_dpo", "--config", "configs/dpo_config.yaml",
              "--output_dir", "models/aligned", "--logging_dir", "logs/training/safe_mm_dpo",
              *small, "max_train_pairs=16", "max_eval_pairs=16", "gradient_accumulation_steps=1"], root)
    res = json.loads((root / "models/aligned/eval_results.json").read_text())
    assert res["loss_type"] == "safe_mm_dpo" and res["world_size"] == 2 and res["steps"] == 4
    assert json.loads((root / "models/aligned/safe_mm_dpo_state.json").read_text())["updates"] == 4
    assert (root / "models/aligned/config.json").is_file()
    assert (root / "logs/training/safe_mm_dpo/metrics.jsonl").is_file()


@pytest.mark.slow
def test_reward_model_on_deepspeed_two_ranks(scorers, tiny_model_dir, tmp_path):
    """`alignrl train rm --nproc 2` on DeepSpeed ZeRO-2 (FSDP2: the seed 002 test): same held-out accuracy before
    training as one process (the head is seeded), and the saved folder is a complete sequence-classification
    model."""
    out = tmp_path / "rm"
    p = run_group([sys.executable, "-m", "alignrl", "train", "rm", "--nproc", "2", "--config",
                   str(REPO / "configs/rm_config.yaml"), "--task", "helpful", "--output_dir", str(out),
                   "--logging_dir", str(tmp_path / "logs"), f"model_path={tiny_model_dir}", "strategy=deepspeed",
                   "max_train_pairs=32", "max_eval_pairs=24", "eval_batch_size=24", "batch_size=4",
                   "report_to=[jsonl]"], 240, env={**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": "60"})
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((out / "eval_results.json").read_text())
    assert res["world_size"] == 2 and res["steps"] == 4 and res["strategy"] == "deepspeed"
    assert res["eval_accuracy_before"] == scorers[1]["eval_accuracy_before"]
    assert _complete_scorer(out)


def _complete_scorer(folder) -> bool:
    from alignrl.models.value import ModelScorer

    ids = torch.tensor([[5, 6, 7]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    return bool(torch.isfinite(ModelScorer(str(folder)).score(ids, mask, ids, mask)).all())


# ---------------------------------------------------------------- folders, divergence, policies (a seed 002 audit)


def _quick(tiny_model_dir, out: Path, logs: Path, *extra: str) -> int:
    return rm_main(["--config", str(REPO / "configs/rm_config.yaml"), "--task", "helpful", "--output_dir", str(out),
                    "--logging_dir", str(logs), f"model_path={tiny_model_dir}", "max_train_pairs=16", *SMALL, *extra])


def test_logs_inside_the_output_folder_move_into_the_saved_model(tiny_model_dir, tmp_path, capsys):
    """--logging_dir <output_dir>/logs was made at the start, so the save found the folder taken, moved it aside
    with the logs in it, and the last metrics row failed (a traceback, exit 1, after the model was saved)."""
    out = tmp_path / "rm"
    for run in range(2):  # the second run finds the first's model there: moved aside, its own logs carried
        assert _quick(tiny_model_dir, out, out / "logs", "max_steps=1") == 0
        assert (out / "model.safetensors").is_file() and (out / "logs" / "metrics.jsonl").is_file()
    asides = list(tmp_path.glob("rm.previous-*"))
    assert len(asides) == 1 and (asides[0] / "model.safetensors").is_file(), asides
    assert _quick(tiny_model_dir, out, out, "max_steps=1") == 2
    assert "the logging folder is the output folder" in capsys.readouterr().err
    # an output path that is a file, or a link to a folder of folders, is moved aside, never removed
    notes, real = tmp_path / "notes", tmp_path / "real"
    notes.write_text("keep me")
    (real / "empty").mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(real)
    for target in (notes, link):
        assert _quick(tiny_model_dir, target, tmp_path / f"logs_{target.name}", "max_steps=1") == 0
        assert (target / "model.safetensors").is_file() and not target.is_symlink()
    assert [p.read_text() for p in tmp_path.glob("notes.previous-*")] == ["keep me"]
    assert (real / "empty").is_dir() and len(list(tmp_path.glob("link.previous-*"))) == 1


def test_a_run_whose_updates_stay_non_finite_stops_and_saves_nothing(tiny_model_dir, tmp_path, capsys):
    """learning_rate=1e30 without clipping: the weights stay finite (about 1e30) but every loss after the first
    step is NaN. The run went on to the end and saved the model (exit 0)."""
    out = tmp_path / "rm"
    assert _quick(tiny_model_dir, out, tmp_path / "logs", "max_train_pairs=64", "log_every=1", "learning_rate=1e30",
                  "grad_clip=0") == 2
    said = capsys.readouterr()
    assert said.err.startswith("alignrl: error: training stopped at step ") and said.err.count("\n") == 1
    assert "the last 3 optimizer step(s) had a non-finite loss or gradient norm and were skipped; nothing is saved" \
        in said.err and "optimizer step skipped" in said.out
    assert not out.exists()
    # a run that ends on such a step (2 steps here) has finite weights and NaN scores: not saved either
    assert _quick(tiny_model_dir, out, tmp_path / "logs", "log_every=1", "learning_rate=1e30", "grad_clip=0") == 2
    assert capsys.readouterr().err.strip() == ("alignrl: error: the trained model gives non-finite scores on the "
                                               "held-out pairs; nothing is saved. Lower learning_rate, keep grad_clip "
                                               "on, or check the pairs")
    assert not out.exists()


def test_a_held_logging_folder_is_refused(tiny_model_dir, tmp_path, capsys):
    """Two runs of one task share the default logging folder: their metrics rows interleaved in one file."""
    logs = tmp_path / "logs"
    logs.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from alignrl.train.checkpoint import "
                               "hold_run_dir; from pathlib import Path; f = hold_run_dir(Path(sys.argv[1])); "
                               "print('held', flush=True); time.sleep(60)", str(logs)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert _quick(tiny_model_dir, tmp_path / "rm", logs, "max_steps=1") == 2
        err = capsys.readouterr().err
        assert f"is writing {logs}: stop it first, or give this run another --logging_dir" in err, err
    finally:
        holder.kill()
        holder.wait()


def test_a_cost_model_run_resumed_from_its_checkpoint_ends_where_the_whole_run_does(tiny_model_dir, tmp_path,
                                                                                      capsys):
    from safetensors.torch import load_file

    small = ["max_train_pairs=32", "max_steps=4", "epochs=1", "batch_size=8", "max_eval_pairs=8"]
    _rm(tmp_path / "whole", tiny_model_dir, "harmless", *small, "save_steps=2")
    ckpt = tmp_path / "whole" / "harmless_rm.checkpoints" / "step_2"
    assert sorted(p.name for p in ckpt.iterdir()) == ["optim.pt", "state.json", "weights.safetensors"]
    _rm(tmp_path / "resumed", tiny_model_dir, "harmless", *small, f"resume_from={ckpt}")
    assert "resumed from" in capsys.readouterr().out
    a, b = (load_file(str(tmp_path / d / "harmless_rm" / "model.safetensors")) for d in ("whole", "resumed"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    rows = [json.loads(x) for x in (tmp_path / "resumed" / "logs_harmless" / "metrics.jsonl").read_text().splitlines()]
    assert min(r["step"] for r in rows if "cost/accuracy" in r) > 2  # only the steps after the checkpoint ran
    assert rm_main(["--task", "harmless", f"model_path={tiny_model_dir}", f"resume_from={tmp_path}",
                    "--output_dir", str(tmp_path / "bad"), "--logging_dir", str(tmp_path / "bad_logs")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"alignrl: error: resume_from={tmp_path} is not a checkpoint of `alignrl train rm` (no weights.safetensors "
        "and state.json); give a checkpoint folder (step_<N>, checkpoint-<N> or global_step_<N>)")
