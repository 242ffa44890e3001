"""The Safe-MM-DPO project's own configs (tests/fixtures/mmdpo, model paths changed) and data layout: they load as
they are, and its three commands train on them (two gloo ranks), λ moving the same on two ranks as in one process."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from conftest import run_group
from alignrl.config import ConfigError
from alignrl.preference.cli import DPOConfig, RMConfig, dpo_main, load_flat_config, parse_dpo, rm_main

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "mmdpo"


def _load(cls, name: str, capsys, *overrides: str):
    cfg = load_flat_config(cls, str(FIXTURES / name), list(overrides), {})
    return cfg, capsys.readouterr().err


def test_the_seed_rm_config_loads_with_a_note_for_its_repeated_key(capsys):
    cfg, err = _load(RMConfig, "rm_config.yaml", capsys)
    assert err.strip() == (f"alignrl: note: {FIXTURES / 'rm_config.yaml'}:36: key 'max_length' is written more than "
                           "once; its last value (512) is used, as PyYAML reads it")
    assert (cfg.model_path, cfg.tokenizer_name, cfg.max_length, cfg.epochs) == ("models/base/tiny-qwen2", None, 512, 2)
    assert (cfg.learning_rate, cfg.batch_size, cfg.gradient_accumulation_steps) == (1e-5, 4, 2)
    assert (cfg.weight_decay, cfg.grad_clip, cfg.classification_loss_weight) == (0.01, 1.0, 1.0)
    assert (cfg.use_lora, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules) == (
        True, 32, 64, 0.1, "all-linear")
    assert (cfg.helpful_train_file, cfg.harmless_eval_file) == ("data/train/helpful_pairs.jsonl",
                                                                "data/val/harmless_pairs.jsonl")


def test_the_seed_dpo_config_loads_greek_keys_and_all(capsys):
    cfg, err = _load(DPOConfig, "dpo_config.yaml", capsys, "λ_init=0.5", "lora.r=8")
    assert err == ""
    assert (cfg.loss_type, cfg.lambda_init, cfg.beta_w, cfg.beta_k, cfg.beta, cfg.lambda_lr) == (
        "safe_mm_dpo", 0.5, 0.5, 0.5, 0.1, 0.01)
    assert (cfg.learning_rate, cfg.batch_size, cfg.kl_coeff, cfg.epochs, cfg.gradient_accumulation_steps) == (
        5e-7, 4, 0.1, 2, 4)
    assert (cfg.grad_clip, cfg.warmup_steps, cfg.max_length, cfg.cost_threshold, cfg.eval_steps, cfg.save_steps) == (
        1.0, 100, 256, 0.0, 250, 500)
    assert (cfg.model_path, cfg.ref_model_path) == ("models/base/tiny-qwen2", "models/base/tiny-qwen2")
    assert (cfg.helpful_rm, cfg.harmless_rm) == ("models/helpful_rm", "models/harmless_rm")
    assert cfg.train_files == ["data/train/helpful_pairs.jsonl", "data/train/harmless_pairs.jsonl"]
    assert cfg.eval_files == ["data/val/helpful_pairs.jsonl", "data/val/harmless_pairs.jsonl"]
    assert (cfg.use_lora, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout) == (True, 8, 32, 0.1)


@pytest.mark.parametrize("text, expect", [
    ("λ_init: 0.0\n", "λ_init (lambda_init) = 0.0 must be > 0: λ moves in log space"),
    ("λ_init: -1\n", "λ_init (lambda_init) = -1.0 must be > 0"),
    ("λ_nit: 1.0\n", "unknown config key 'λ_nit'"),
    ("lora: {r: 8, rank: 4}\n", "unknown key lora.rank; the lora block takes r, alpha, dropout, target_modules"),
    ("β_ori: 0.1\nbeta: 0.2\n", "β_ori=0.1 and beta=0.2 set the same thing"),
    ("w: [1\n", "cannot parse"),
])
def test_seed_config_mistakes_are_one_line(text, expect, tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text(text, encoding="utf-8")
    assert dpo_main(["--config", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("alignrl: error:") and expect in err and "\n" not in err, err


def test_safe_is_safe_odpo_with_a_note(capsys):
    assert parse_dpo(["loss_type=safe"]).loss_type == "safe_odpo"
    assert "loss_type=safe is the older name of safe_odpo" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="kl_coeff=0.1 needs the reference's logits"):
        parse_dpo(["kl_coeff=0.1", "--precompute_ref_log_probs"])


def _rows(n: int, harmless: bool, start: int = 0) -> list[dict]:
    """The Safe-MM-DPO project's rows (prepare_data.py's output), from the shipped synthetic pairs."""
    from alignrl.data.preference import load_pairs

    pairs = load_pairs("builtin:harmless" if harmless else "builtin:helpful", "better")[start:start + n]
    out = []
    for p in pairs:
        row = {"prompt": p.prompt[-1]["content"], "chosen_response": p.chosen, "rejected_response": p.rejected,
               "dimension": "harmless" if harmless else "helpful"}
        if harmless:
            row["safety_labels"] = {"chosen": -1 if p.chosen_safe else 1, "rejected": -1 if p.rejected_safe else 1}
        out.append(row)
    return out


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def test_seed_rows_load_with_their_safety_labels(tmp_path):
    from alignrl.data.loaders import DataError
    from alignrl.data.preference import load_pairs

    f = tmp_path / "harmless_pairs.jsonl"
    _write(f, _rows(4, True))
    pairs = load_pairs(str(f))
    want = _rows(4, True)
    assert [p.chosen for p in pairs] == [r["chosen_response"] for r in want]
    assert [(p.chosen_safe, p.rejected_safe) for p in pairs] == [
        (r["safety_labels"]["chosen"] == -1, r["safety_labels"]["rejected"] == -1) for r in want]
    _write(f, [{**want[0], "safety_labels": {"chosen": True, "rejected": 1}}])
    with pytest.raises(DataError, match=r"harmless_pairs.jsonl:1: safety_labels must be"):
        load_pairs(str(f))
    _write(f, [{"prompt": "p", "chosen_response": "a"}])
    with pytest.raises(DataError, match="row is missing rejected_response"):
        load_pairs(str(f))


def _seed_project(tmp: Path, model: Path) -> Path:
    """A root laid out as the Safe-MM-DPO project: its configs, data files in its layout, the tiny model at the
    configs' base path; this repository's scripts and src."""
    root = tmp / "mmdpo"
    (root / "configs").mkdir(parents=True)
    for name in ("rm_config.yaml", "dpo_config.yaml"):
        shutil.copy(FIXTURES / name, root / "configs" / name)
    for name in ("scripts", "src"):
        (root / name).symlink_to(REPO / name)
    (root / "models" / "base").mkdir(parents=True)
    (root / "models" / "base" / "tiny-qwen2").symlink_to(model)
    for harmless, name in ((False, "helpful"), (True, "harmless")):
        _write(root / "data" / "train" / f"{name}_pairs.jsonl", _rows(8, harmless))
        _write(root / "data" / "val" / f"{name}_pairs.jsonl", _rows(4, harmless, start=8))
    return root


def _run(cmd: list[str], root: Path) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "ALIGNRL_DIST_TIMEOUT": "120", "PYTHON": sys.executable}
    env.pop("WORLD_SIZE", None)
    p = run_group(cmd, 300, cwd=root, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr


SMALL = ["batch_size=2", "gradient_accumulation_steps=1", "max_length=64", "eval_batch_size=8", "report_to=[jsonl]",
         "log_every=1"]


@pytest.mark.slow
def test_the_seed_commands_run_on_its_configs_two_ranks(tiny_model_dir, tmp_path, monkeypatch):
    from alignrl.models.value import ModelScorer

    if not shutil.which("bash"):
        pytest.skip("no bash")
    root = _seed_project(tmp_path, tiny_model_dir)
    said = _run(["bash", "scripts/train_rm_distributed.sh", "helpful", "2", *SMALL, "max_steps=1"], root)
    assert said.count("key 'max_length' is written more than once") == 1, said  # once, not once per rank
    res = json.loads((root / "models" / "helpful_rm" / "eval_results.json").read_text())
    assert res["world_size"] == 2 and res["steps"] == 1
    monkeypatch.chdir(root)  # the cost model in this process (two ranks of the script: the helpful run above)
    assert rm_main(["--config", "configs/rm_config.yaml", "--task", "harmless", *SMALL, "max_steps=1"]) == 0
    for task in ("helpful", "harmless"):
        assert ModelScorer(str(root / "models" / f"{task}_rm")).model is not None  # merged: a plain scorer
    # Safe-MM-DPO on two ranks, then one process on the same global batches: λ moves the same
    lora = ["lora.dropout=0", "learning_rate=1e-3", "max_steps=2"]
    said = _run(["bash", "scripts/train_dpo_distributed.sh", "2", *SMALL, *lora], root)
    two = [json.loads(r) for r in (root / "logs/training/safe_mm_dpo/metrics.jsonl").read_text().splitlines()]
    res = json.loads((root / "models/aligned/eval_results.json").read_text())
    assert res["loss_type"] == "safe_mm_dpo" and res["world_size"] == 2 and res["steps"] == 2 and res["use_lora"]
    for key in ("loss_total", "loss_helpful", "loss_safety", "loss_kl", "reward_helpful_mean", "reward_safety_mean",
                "delta_helpful_mean", "delta_safety_mean", "lambda", "beta_helpful_mean", "beta_safety_mean",
                "kl_divergence"):
        assert key in two[0], key
    assert dpo_main(["--config", "configs/dpo_config.yaml", "--output_dir", "models/aligned_one", "--logging_dir",
                     "logs/one", *SMALL, *lora, "batch_size=4"]) == 0
    one = [json.loads(r) for r in (root / "logs/one/metrics.jsonl").read_text().splitlines()]
    lam2, lam1 = [r["lambda"] for r in two if "lambda" in r], [r["lambda"] for r in one if "lambda" in r]
    assert len(lam2) == len(lam1) == 2 and lam2[1] != 1.0
    assert lam2 == pytest.approx(lam1, rel=1e-6)
    assert json.loads((root / "models/aligned/safe_mm_dpo_state.json").read_text())["lambda"] == lam2[-1]
