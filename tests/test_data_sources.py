"""Datasets read through the `datasets` library as OpenRLHF's and TRL's loaders read them: a folder laid out as a Hub
dataset repository, a `save_to_disk` folder, a .csv file, OpenRLHF's `@data_dir`, a Hub name (offline here: its one
line), each feeding the RL prompts and the preference pairs as a .jsonl file does."""

from __future__ import annotations

import io
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from alignrl.data.loaders import DataError, check_data_file, count_rows, load_samples, read_rows
from alignrl.data.preference import load_pairs
from alignrl.data.sources import DatasetSpec, is_library_dataset, library_rows


def gsm8k(prefix: str, n: int) -> list[dict]:
    return [{"question": f"{prefix} {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(n)]


def hub_layout(root: Path, splits: dict[str, list[dict]], folder: str = "data") -> Path:
    """A folder as a Hub dataset repository keeps its files: data/<split>-00000-of-00001.parquet."""
    (root / folder).mkdir(parents=True)
    for split, rows in splits.items():
        pq.write_table(pa.Table.from_pylist(rows), root / folder / f"{split}-00000-of-00001.parquet")
    return root


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and "Traceback" not in message, message
    return message


def test_a_hub_layout_folder_gives_train_to_training_and_test_to_held_out_settings(tmp_path):
    repo = hub_layout(tmp_path / "gsm8k", {"train": gsm8k("train", 5), "test": gsm8k("test", 3)})
    train = load_samples(str(repo), key="data.train_files")
    held = load_samples(str(repo), key="data.val_files")
    assert [s.messages[-1]["content"] for s in train] == [r["question"] for r in gsm8k("train", 5)]
    assert [s.ground_truth for s in held] == ["1", "2", "3"] and held[0].messages[-1]["content"] == "test 0 + 1?"
    assert train[0].source == f"{repo} [train] row 0"  # messages name the split and row
    assert count_rows(str(repo)) == 5 and count_rows(str(repo), key="data.val_files") == 3
    assert len(load_samples(str(repo), limit=2)) == 2
    check_data_file(str(repo))  # a folder passes the pre-launch check


def test_save_to_disk_folders_csv_files_and_openrlhfs_data_dir(tmp_path):
    datasets.Dataset.from_list(gsm8k("saved", 4)).save_to_disk(str(tmp_path / "saved"))
    assert [s.messages[-1]["content"] for s in load_samples(str(tmp_path / "saved"))][-1] == "saved 3 + 1?"
    whole = datasets.DatasetDict({"train": datasets.Dataset.from_list(gsm8k("a", 2)),
                                  "validation": datasets.Dataset.from_list(gsm8k("v", 1))})
    whole.save_to_disk(str(tmp_path / "dict"))
    held = load_samples(str(tmp_path / "dict"), key="--eval_dataset")
    assert [s.messages[-1]["content"] for s in held] == ["v 0 + 1?"]
    csv = tmp_path / "rows.csv"
    csv.write_text("question,answer\nWhat is 2+2?,#### 4\n")
    assert load_samples(str(csv))[0].ground_truth == "4"
    # OpenRLHF's name@data_dir: one folder of a repository holding several datasets
    repo = hub_layout(tmp_path / "multi", {"train": gsm8k("first", 2)}, folder="first")
    hub_layout(repo, {"train": gsm8k("second", 3)}, folder="second")
    second = load_samples(f"{repo}@second")
    assert [s.messages[-1]["content"] for s in second] == [r["question"] for r in gsm8k("second", 3)]


def test_preference_pairs_from_a_dataset_folder(tmp_path):
    rows = [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(3)]
    repo = hub_layout(tmp_path / "pairs", {"train": rows})
    pairs = load_pairs(str(repo), key="--dataset")
    assert [p.chosen for p in pairs] == ["good 0", "good 1", "good 2"] and pairs[2].rejected == "bad 2"


def test_a_hub_name_offline_is_one_line_naming_the_setting_and_the_fix(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    assert is_library_dataset("OpenRLHF/preference_dataset_mixture2_and_safe_pku")
    check_data_file("OpenRLHF/preference_dataset_mixture2_and_safe_pku", "--dataset")  # checked when loaded
    with pytest.raises(DataError) as e:
        load_pairs("OpenRLHF/preference_dataset_mixture2_and_safe_pku", key="--dataset")
    message = one_line(e)
    assert message.startswith("--dataset: could not load dataset 'OpenRLHF/preference_dataset_mixture2_and_safe_pku'")
    assert "download it first and give its folder" in message, message


def test_what_is_a_file_a_folder_or_a_hub_name(tmp_path):
    assert DatasetSpec.parse("openai/gsm8k#main@data") == DatasetSpec("openai/gsm8k", "main", "data")
    assert DatasetSpec.parse("openai/gsm8k#main[test]") == DatasetSpec("openai/gsm8k", "main", None, "test")
    assert is_library_dataset("openai/gsm8k#main[test]") and is_library_dataset(f"{tmp_path}[train]")
    assert not is_library_dataset(str(tmp_path / "missing.jsonl"))
    assert not is_library_dataset("prompts.txt") and not is_library_dataset("/abs/missing")
    with pytest.raises(DataError) as e:  # a missing file of a known kind stays "not found", not a Hub lookup
        read_rows(str(tmp_path / "missing.parquet"), "data.train_files")
    assert "data file not found" in one_line(e)
    with pytest.raises(DataError) as e:
        check_data_file("train.txt", "data.train_files")
    assert "data file not found" in one_line(e)


def test_splits_without_train_and_image_columns(tmp_path):
    repo = hub_layout(tmp_path / "odd", {"dev": gsm8k("d", 1), "holdout": gsm8k("h", 1)})
    with pytest.raises(DataError) as e:
        load_samples(str(repo))
    assert "has splits dev, holdout and none named train" in one_line(e) and f"{repo}[split]" in str(e.value)
    assert [s.ground_truth for s in load_samples(f"{repo}[holdout]")] == ["1"]  # a split named in brackets
    with pytest.raises(DataError) as e:
        count_rows(f"{repo}[missing]")
    assert "none named missing" in one_line(e)
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), "red").save(buffer, format="PNG")
    features = datasets.Features({"prompt": datasets.Value("string"), "images": datasets.List(datasets.Image())})
    data = datasets.Dataset.from_dict({"prompt": ["<image>what colour?"], "images": [[buffer.getvalue()]]},
                                      features=features)
    data.save_to_disk(str(tmp_path / "pictures"))
    columns, rows = library_rows(str(tmp_path / "pictures"), "data.train_files")
    assert columns == ["prompt", "images"]
    image = rows[0][1]["images"][0]  # verl's {"bytes", "path"} item, which alignrl's image layouts read
    assert isinstance(image, dict) and image["bytes"] == buffer.getvalue()


def test_a_held_out_setting_falls_back_to_train_and_a_mistyped_folder_says_so(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    repo = hub_layout(tmp_path / "two", {"train": gsm8k("t", 2), "dev": gsm8k("d", 1)})
    assert len(load_samples(str(repo), key="data.val_files")) == 2  # no test or validation: train, said once
    load_samples(str(repo), key="data.val_files")
    assert capsys.readouterr().err.count("has no test or validation split; its train split is held out") == 1
    assert not is_library_dataset("") and not is_library_dataset(".")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as e:
        load_samples("data/my_prompts")
    assert f"no local file or folder data/my_prompts (from {tmp_path})" in one_line(e)


def test_epochs_count_a_dataset_folders_rows_and_a_copied_held_out_set_drops_the_training_split(tmp_path):
    from alignrl.config import load_config
    from alignrl.preference.cli import parse_rm

    datasets.Dataset.from_list(gsm8k("n", 9)).save_to_disk(str(tmp_path / "nine"))
    cfg = load_config(None, [f"data.train_files={tmp_path / 'nine'}", "trainer.total_epochs=2",
                             "data.train_batch_size=3", "actor.ppo_mini_batch_size=3"])
    assert cfg.trainer.total_training_steps == 6  # 9 rows / 3 a step, twice
    rm = parse_rm(["--pretrain", "demo", "--dataset", "owner/prefs", "--train_split", "dev"])
    assert (rm.helpful_train_file, rm.helpful_eval_file) == ("owner/prefs[dev]", "owner/prefs")  # test, else ...
