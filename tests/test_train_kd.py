"""`alignrl train kd` on the tiny test model: the student's KL to a sharper teacher falls (measured on the trained
tokens before and after), kd_coef=0 is plain SFT's step exactly, a packed step is the padded one (the teacher reads
the same position ids), padded heads are matched, and a wrong teacher is one line; OpenRLHF's module spelling
(`python -m openrlhf.cli.train_kd`) runs the command."""

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from alignrl.preference.kd_cli import kd_main, parse_kd
from alignrl.preference.sft_cli import sft_main

ROWS = [{"prompt": f"count from {i}", "completion": " ".join(str(i + k) for k in range(1 + i % 4))} for i in range(16)]
ONE_STEP = ["max_steps=1", "batch_size=4", "learning_rate=1e-3", "warmup_ratio=0", "max_length=40"]
ROOT = Path(__file__).resolve().parents[1]


def _write(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _line(model: Path, tmp: Path, name: str, *extra: str) -> list[str]:
    return [f"model_path={model}", f"train_files=[{_write(tmp / 'train.jsonl', ROWS)}]", "--output_dir",
            str(tmp / name), "--logging_dir", str(tmp / f"logs_{name}"), "report_to=[jsonl]", "log_every=1", *extra]


def _metrics(tmp: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (tmp / f"logs_{name}" / "metrics.jsonl").read_text().splitlines()]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def teacher(tiny_model_dir, tmp_path_factory) -> Path:
    """A sharper model of the same tokenizer: the tiny model after a few SFT epochs on the rows."""
    tmp = tmp_path_factory.mktemp("teacher")
    assert sft_main(_line(tiny_model_dir, tmp, "teacher", "batch_size=4", "epochs=4", "learning_rate=3e-3",
                          "warmup_ratio=0")) == 0
    return tmp / "teacher"


def _kl_to_teacher(student: Path, teacher: Path, tmp: Path) -> float:
    """The token mean of KL(teacher ‖ student) over the rows' trained tokens, as the trainer's batches give them."""
    from alignrl.core.distill import distill_per_token
    from alignrl.data.sft_rows import collate_rows
    from alignrl.models.loader import load_model
    from alignrl.preference.sft import _encode, _keys, _load, trained_logits

    cfg = parse_kd([f"teacher_model_path={teacher}", f"train_files=[{tmp / 'train.jsonl'}]", "max_length=40"])
    (s_model, tok), (t_model, _) = load_model(str(student)), load_model(str(teacher))
    rows = _load(cfg.train_files, _keys(cfg, False), 0, "train_files")
    enc, _, _ = _encode(tok, cfg, rows, [], type("Quiet", (), {"print": lambda *_: None})())
    batch = collate_rows(enc, tok.pad_token_id, 1.0)
    with torch.no_grad():
        s, _ = trained_logits(s_model, batch, cfg, torch.device("cpu"))
        t, _ = trained_logits(t_model, batch, cfg, torch.device("cpu"))
    entropy = -(torch.softmax(t, -1) * torch.log_softmax(t, -1)).sum(-1)
    return float((distill_per_token(s, t) - entropy).mean())


@pytest.mark.parametrize("beta", [0.0, 0.5])  # OpenRLHF's loss; GKD's generalized JSD
def test_the_student_moves_toward_the_teacher_and_logs_both_losses(tiny_model_dir, teacher, tmp_path, beta):
    rc = kd_main(_line(tiny_model_dir, tmp_path, "kd", f"teacher_model_path={teacher}", "kd_coef=1", "batch_size=4",
                       "epochs=2", "learning_rate=3e-3", "warmup_ratio=0", f"beta={beta}"))
    assert rc == 0
    before = _kl_to_teacher(tiny_model_dir, teacher, tmp_path)
    after = _kl_to_teacher(tmp_path / "kd", teacher, tmp_path)
    print(f"KL(teacher || student) on the trained tokens: {before:.4f} -> {after:.4f}")
    assert after < 0.5 * before, (before, after)
    rows = _metrics(tmp_path, "kd")
    assert len(rows) == 8 and {"train/loss", "train/gpt_loss", "train/distil_loss"} <= set(rows[0])
    assert all(r["train/loss"] == pytest.approx(r["train/distil_loss"], rel=1e-6) for r in rows)  # kd_coef 1
    assert rows[-1]["train/distil_loss"] < rows[0]["train/distil_loss"]
    res = json.loads((tmp_path / "kd" / "eval_results.json").read_text())
    assert res["kd_coef"] == 1.0 and res["teacher_model_path"] == str(teacher) and res["beta"] == beta


def test_kd_coef_zero_is_plain_sfts_step_exactly(tiny_model_dir, teacher, tmp_path):
    assert sft_main(_line(tiny_model_dir, tmp_path, "sft", *ONE_STEP)) == 0
    assert kd_main(_line(tiny_model_dir, tmp_path, "kd", f"teacher_model_path={teacher}", "kd_coef=0",
                         *ONE_STEP)) == 0
    sft, kd = _weights(tmp_path / "sft"), _weights(tmp_path / "kd")
    assert any(not torch.equal(sft[k], w) for k, w in _weights(tiny_model_dir).items())  # the step moved them
    assert all(torch.equal(sft[k], kd[k]) for k in sft)
    (plain,), (step,) = _metrics(tmp_path, "sft"), _metrics(tmp_path, "kd")
    assert step["train/loss"] == plain["train/loss"] == step["train/gpt_loss"]
    assert step["train/distil_loss"] > 0


def test_a_packed_step_is_the_padded_one(tiny_model_dir, teacher, tmp_path):
    """The teacher runs on the packed sequences with their restarting position ids: the same loss and update."""
    same = [f"teacher_model_path={teacher}", *ONE_STEP]
    assert kd_main(_line(tiny_model_dir, tmp_path, "padded", *same)) == 0
    assert kd_main(_line(tiny_model_dir, tmp_path, "packed", "--packing_samples", *same)) == 0
    padded, packed = _weights(tmp_path / "padded"), _weights(tmp_path / "packed")
    for k in padded:
        torch.testing.assert_close(packed[k], padded[k], rtol=0, atol=1e-5)
    (a,), (b,) = _metrics(tmp_path, "padded"), _metrics(tmp_path, "packed")
    assert b["train/distil_loss"] == pytest.approx(a["train/distil_loss"], rel=1e-5)
    assert b["train/gpt_loss"] == pytest.approx(a["train/gpt_loss"], rel=1e-5)


def _resized(model: Path, folder: Path, size: int, tokenizer=None) -> Path:
    from alignrl.models.loader import load_model

    m, tok = load_model(str(model))
    m.resize_token_embeddings(size)
    m.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer(tok).save_pretrained(folder)
    return folder


def test_a_padded_head_is_matched_and_a_wrong_teacher_is_one_line(tiny_model_dir, tmp_path, capsys):
    padded = _resized(tiny_model_dir, tmp_path / "padded", 320)  # 300 tokens: 20 entries of padding
    assert kd_main(_line(tiny_model_dir, tmp_path, "kd", f"teacher_model_path={padded}", *ONE_STEP)) == 0
    assert "the teacher's head has 320 entries and the student's 300" in capsys.readouterr().out
    smaller = _resized(tiny_model_dir, tmp_path / "smaller", 290)
    other_tok = _resized(tiny_model_dir, tmp_path / "other_tok", 300,
                         lambda tok: (tok.add_tokens(["<extra_token>"]), tok)[1])
    cases = {smaller: "the teacher's vocabulary has 290 entries and the student's 300 (its tokenizer 300 tokens)",
             other_tok: "its tokenizer has 301 tokens and the student's 300",
             tmp_path / "nowhere": "is not a Hugging Face model folder"}
    for path, said in cases.items():
        capsys.readouterr()
        assert kd_main(_line(tiny_model_dir, tmp_path, "bad", f"teacher_model_path={path}", *ONE_STEP)) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("alignrl: error: teacher_model_path=") and said in err, err


def test_openrlhfs_module_spelling_runs_the_command(capsys, monkeypatch):
    shim = str(ROOT / "openrlhf" / "cli" / "train_kd.py")
    monkeypatch.syspath_prepend(str(ROOT))  # `python3 -m openrlhf.cli.train_kd` from the repository root
    monkeypatch.setattr(sys, "argv", [shim, "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(shim, run_name="__main__")
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the epilog
    assert done.value.code == 0 and out.startswith("usage: alignrl train kd") and "--teacher_model -> teacher" in out
    monkeypatch.setattr(sys, "argv", [shim, "--pretrain", "s", "--teacher_model", "t", "--dataset", "a.jsonl",
                                      "--lmbda", "0.5", "--packing_samples"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(shim, run_name="__main__")
    err = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and err[-1].startswith("alignrl: error: lmbda=0.5: generated completions replace")


def test_flags_of_openrlhf_and_trl_read_as_keys(capsys):
    cfg = parse_kd(["--pretrain", "s", "--teacher_model", "t", "--dataset", "a.jsonl", "--kd_coef", "0.3",
                    "--teacher_offload"])
    assert (cfg.model_path, cfg.teacher_model_path, cfg.kd_coef, cfg.learning_rate) == ("s", "t", 0.3, 5e-6)
    assert "--teacher_offload changes nothing here" in capsys.readouterr().err
    trl = parse_kd(["--model_name_or_path", "s", "--teacher_model_name_or_path", "t", "--dataset_name", "a.jsonl",
                    "--lmbda", "0"])
    # GKD's: the divergence alone, its generalized JSD at beta 0.5
    assert (trl.teacher_model_path, trl.kd_coef, trl.temperature, trl.beta) == ("t", 1.0, 0.9, 0.5)
    assert parse_kd(["--model_name_or_path", "s", "--teacher_model_name_or_path", "t", "--dataset_name", "a.jsonl",
                     "--beta", "1"]).beta == 1.0
    assert "GKD's lmbda 0.5 where the line is silent" in capsys.readouterr().err  # GKD's on-policy half, said
    trl_line = ["--model_name_or_path", "s", "--teacher_model_name_or_path", "t", "--dataset_name", "a.jsonl"]
    off = parse_kd(trl_line + ["--lmbda", "0.", "--seq_kd", "no", "--disable_dropout", "true"])  # TRL's spellings
    assert (off.lmbda, off.seq_kd) == (0.0, False)
    assert parse_kd(trl_line + ["--seq_kd"]).seq_kd  # bare: TRL reads it as true
    from alignrl.config import ConfigError

    with pytest.raises(ConfigError, match="^teacher_model_path is empty"):
        parse_kd(["train_files=[a.jsonl]"])


def test_a_bf16_teacher_halves_its_copy_and_still_teaches(tiny_model_dir, teacher, tmp_path, capsys):
    """teacher_dtype=bfloat16 (auto under a bf16 run, as OpenRLHF's --bf16): the teacher loads in bfloat16, its
    logits go to float32 for the loss, and the step trains."""
    rc = kd_main(_line(tiny_model_dir, tmp_path, "kd16", f"teacher_model_path={teacher}", "kd_coef=1",
                       "teacher_dtype=bfloat16", "batch_size=4", "max_steps=2", "learning_rate=3e-3"))
    out = capsys.readouterr().out
    assert rc == 0 and "frozen, bfloat16 on cpu" in out, out[-2000:]
    rows = _metrics(tmp_path, "kd16")
    assert all(torch.isfinite(torch.tensor(r["train/distil_loss"])) for r in rows) and len(rows) == 2
