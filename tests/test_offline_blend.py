"""Several training files weighed by `train_files_probs` (OpenRLHF's --dataset_probs) on the offline commands: the
rows are drawn as `datasets.interleave_datasets(probabilities, seed, stopping_strategy="all_exhausted")` draws them
(`blend_order`, checked against datasets itself in test_openrlhf_blend_rm), a paired KTO line stays whole, DPO pairs keep
their file, --max_samples caps each file and then the blend, and a wrong weight list is one line."""

import json
from pathlib import Path

import pytest

from alignrl.data.kto_rows import KTOKeys
from alignrl.data.blend import blend_order, read_files
from alignrl.data.loaders import DataError
from alignrl.preference import dpo, kto, sft
from alignrl.preference.cli import parse_dpo
from alignrl.preference.sft_cli import parse_sft, sft_main


def _write(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _files(tmp_path: Path, layout) -> list[str]:
    return [_write(tmp_path / "a.jsonl", [layout("a", i) for i in range(6)]),
            _write(tmp_path / "b.jsonl", [layout("b", i) for i in range(2)])]


def test_read_files_concatenates_or_blends_and_caps():
    def read(f, n):
        return [f"{f}{i}" for i in range(5 if f == "x" else 2)][:n]

    assert [u for _, u in read_files(["x", "y"], read, 6)] == ["x0", "x1", "x2", "x3", "x4", "y0"]
    got = read_files(["x", "y"], read, None, [0.3, 0.7], seed=3)
    assert got == [(f, f"{'xy'[f]}{i}") for f, i in blend_order([5, 2], [0.3, 0.7], 3)]
    assert {u for _, u in got} == {"x0", "x1", "x2", "x3", "x4", "y0", "y1"}  # every row once at least
    capped = read_files(["x", "y"], read, 3, [0.5, 0.5], seed=3)  # each file's first 3, then the blend's first 3
    assert len(capped) == 3 and all(u[1] in "012" for _, u in capped)
    assert read_files(["x"], read, None, ["1.0"]) == [(0, f"x{i}") for i in range(5)]  # one file: as it is
    for bad in ([0.5], [1, 0], ["a", "b"], [1, float("inf")]):
        with pytest.raises(DataError, match=r"^train_files_probs=.*: give one weight above 0 per train_files file"):
            read_files(["x", "y"], read, None, bad)


def test_sft_rows_are_drawn_by_weight(tmp_path):
    files = _files(tmp_path, lambda f, i: {"prompt": f"{f}{i}", "completion": "ok"})
    cfg = parse_sft([f"train_files={json.dumps(files)}", "--dataset_probs", "0.2,0.8", "seed=5"])
    rows = sft._load(files, sft._keys(cfg, False), 0, "train_files", cfg.train_files_probs, cfg.seed)
    order = blend_order([6, 2], [0.2, 0.8], 5)
    assert [r.prompt for r in rows] == [f"{'ab'[f]}{i}" for f, i in order]
    assert sum(r.prompt.startswith("b") for r in rows) > 2  # the small file's rows come again, by its weight


def test_a_paired_kto_line_stays_whole_and_dpo_pairs_keep_their_file(tmp_path):
    paired = _files(tmp_path, lambda f, i: {"prompt": f"{f}{i}", "chosen": "y", "rejected": "n"})
    rows = kto._load(paired, KTOKeys(), 0, "train_files", [0.5, 0.5], 1)
    lines = [(f, i) for f, i in blend_order([6, 2], [0.5, 0.5], 1)]
    assert [r.prompt for r in rows] == [f"{'ab'[f]}{i}" for f, i in lines for _ in range(2)]
    assert [r.desirable for r in rows] == [True, False] * len(lines)
    cfg = parse_dpo([f"train_files={json.dumps(paired)}", "train_files_probs=[0.5,0.5]", "seed=1"])
    pairs, group = dpo._load(paired, cfg, 3, "train_files", cfg.train_files_probs)
    assert group == [f for f, _ in lines[:3]] and len(pairs) == 3


@pytest.mark.timeout(120)
def test_an_openrlhf_line_trains_on_the_blend(tiny_model_dir, tmp_path, capsys):
    files = _files(tmp_path, lambda f, i: {"question": f"{f} {i}", "answer": "yes"})
    rc = sft_main(["--pretrain", str(tiny_model_dir), "--dataset", ",".join(files), "--dataset_probs", "0.5,0.5",
                   "--input_key", "question", "--output_key", "answer", "--save_path", str(tmp_path / "out"),
                   "--micro_train_batch_size", "2", "--train_batch_size", "2", "--max_epochs", "1",
                   "--logging_dir", str(tmp_path / "logs"), "report_to=[jsonl]", "max_steps=1"])
    assert rc == 0, capsys.readouterr().err
    results = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert results["train_rows"] == len(blend_order([6, 2], [0.5, 0.5], 42))  # OpenRLHF's seed 42
