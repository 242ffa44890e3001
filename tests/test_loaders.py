"""Dataset loading: both formats, both file types, auto-detection, and the user-facing errors."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from alignrl.data.loaders import (
    DataError,
    load_samples,
    write_gsm8k_jsonl,
    write_verl_parquet,
)
from alignrl.data.records import Sample

GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A car costs $1,200 plus $34. Total?", "answer": "1200 + 34 = 1234\n#### 1,234"},
]


def _error(excinfo: pytest.ExceptionInfo[DataError]) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_gsm8k_jsonl_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    write_gsm8k_jsonl(GSM8K_ROWS, path)
    samples = load_samples(str(path))
    assert samples == [
        Sample(
            messages=[{"role": "user", "content": GSM8K_ROWS[0]["question"]}],
            ground_truth="7",
            data_source="gsm8k",
            extra={"answer": GSM8K_ROWS[0]["answer"]},
        ),
        Sample(
            messages=[{"role": "user", "content": GSM8K_ROWS[1]["question"]}],
            ground_truth="1234",
            data_source="gsm8k",
            extra={"answer": GSM8K_ROWS[1]["answer"]},
        ),
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["train.jsonl"]  # no temp file left behind


def test_gsm8k_parquet_with_system_prompt_and_limit(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS), path)
    samples = load_samples(str(path), "gsm8k", system_prompt="Think step by step.", limit=1)
    assert len(samples) == 1
    assert samples[0].messages == [
        {"role": "system", "content": "Think step by step."},
        {"role": "user", "content": GSM8K_ROWS[0]["question"]},
    ]
    assert samples[0].ground_truth == "7"


def test_ground_truth_uses_last_hash_marker(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    write_gsm8k_jsonl([{"question": "q", "answer": "#### 1\nretry\n####  -2,500 "}], path)
    assert load_samples(str(path))[0].ground_truth == "-2500"


def test_verl_parquet_chat_prompt(tmp_path: Path) -> None:
    path = tmp_path / "verl.parquet"
    rows = [
        {
            "data_source": "lighteval/MATH",
            "prompt": [
                {"role": "system", "content": "Box the answer."},
                {"role": "user", "content": "What is 1/2 + 1/4?"},
            ],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "\\frac{3}{4}"},
            "extra_info": {"split": "train", "index": 5},
        }
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    (sample,) = load_samples(str(path), system_prompt="ignored: prompt has its own system turn")
    assert sample.messages == rows[0]["prompt"]
    assert sample.ground_truth == "\\frac{3}{4}"
    assert sample.data_source == "lighteval/MATH"
    assert sample.extra == {"split": "train", "index": 5}


def test_verl_jsonl_without_extra_info(tmp_path: Path) -> None:
    path = tmp_path / "verl.jsonl"
    row = {
        "data_source": "gsm8k",
        "prompt": [{"role": "user", "content": "2+2?"}],
        "reward_model": {"style": "rule", "ground_truth": 4},
    }
    path.write_text(json.dumps(row) + "\n\n")
    (sample,) = load_samples(str(path), "verl")
    assert sample.ground_truth == "4"
    assert sample.extra == {}


def test_rows_that_stopped_a_run_later_are_one_line_at_load(tmp_path: Path) -> None:
    """extra_info that is not an object (a JSON-encoded string, say) was a ValueError traceback; an empty prompt
    was refused by the engine only when the sampler reached its row. A first line's UTF-8 BOM is read past."""
    row = {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "2+2?"}],
           "reward_model": {"style": "rule", "ground_truth": 4}}
    path = tmp_path / "verl.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps({**row, "extra_info": '{"split": "train"}'}) + "\n")
    with pytest.raises(DataError) as e:
        load_samples(str(path), "verl")
    assert _error(e).startswith(f"{path}:2: extra_info is a str, not an object")
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"input": "1+1?", "label": "2"}) + "\n" + json.dumps({"input": " ", "label": "2"}) + "\n")
    with pytest.raises(DataError) as e:
        load_samples(str(empty), prompt_key="input", label_key="label", apply_chat_template=False)
    assert _error(e) == f"{empty}:2: input is empty; give every row a prompt, or drop the row"
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + (json.dumps(GSM8K_ROWS[0]) + "\n").encode())
    assert load_samples(str(bom), "gsm8k")[0].ground_truth == "7"


def test_write_verl_parquet_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "gsm8k.jsonl"
    write_gsm8k_jsonl(GSM8K_ROWS, src)
    samples = load_samples(str(src), system_prompt="sys")
    out = tmp_path / "nested" / "verl.parquet"
    write_verl_parquet(samples, out)
    assert pq.read_table(out).column_names == ["data_source", "prompt", "reward_model", "extra_info"]
    assert load_samples(str(out)) == samples


def test_write_verl_parquet_drops_empty_extra(tmp_path: Path) -> None:
    samples = [Sample(messages=[{"role": "user", "content": "1+1?"}], ground_truth="2", extra={})]
    out = tmp_path / "verl.parquet"
    write_verl_parquet(samples, out)
    assert "extra_info" not in pq.read_table(out).column_names
    assert load_samples(str(out)) == samples


def test_auto_detect_picks_format_by_columns(tmp_path: Path) -> None:
    gsm = tmp_path / "a.jsonl"
    write_gsm8k_jsonl(GSM8K_ROWS[:1], gsm)
    verl = tmp_path / "b.parquet"
    write_verl_parquet([Sample([{"role": "user", "content": "q"}], "3", "math", {"k": "v"})], verl)
    assert load_samples(str(gsm))[0].data_source == "gsm8k"
    assert load_samples(str(verl))[0].data_source == "math"


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.jsonl"
    with pytest.raises(DataError) as excinfo:
        load_samples(str(path))
    assert _error(excinfo) == (
        f"data file not found: {path} (set data.train_files to an existing .jsonl, .json or .parquet file)"
    )


def test_unsupported_extension(tmp_path: Path) -> None:
    path = tmp_path / "train.txt"
    path.write_text("question,answer\n")
    with pytest.raises(DataError) as excinfo:
        load_samples(str(path))
    assert _error(excinfo) == (f"unsupported data file extension '.txt' for {path} (use .jsonl, .json, .parquet or "
                               ".csv, a dataset folder or a Hub dataset name)")


def test_bad_json_line_reports_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(GSM8K_ROWS[0]) + "\n{not json\n")
    with pytest.raises(DataError) as excinfo:
        load_samples(str(path))
    message = _error(excinfo)
    assert message.startswith(f"{path}:2: line is not valid JSON (")
    assert message.endswith("(each line of a .jsonl file must be one JSON object)")


def test_json_line_that_is_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text("[1, 2]\n")
    with pytest.raises(DataError) as excinfo:
        load_samples(str(path))
    assert _error(excinfo).startswith(f"{path}:1: line is a JSON list, not an object")


def test_unknown_columns_name_both_formats(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"q": "x", "a": "y"}) + "\n")
    with pytest.raises(DataError) as excinfo:
        load_samples(str(path))
    assert _error(excinfo) == (
        f"{path}: cannot tell the data format from columns ['a', 'q'] "
        "(GSM8K needs question, answer; verl needs prompt, data_source, reward_model; for other columns "
        "set data.prompt_key=<prompt column> and data.label_key=<answer column>)"
    )


def test_explicit_format_missing_column(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "x"}]), path)
    with pytest.raises(DataError) as excinfo:
        load_samples(str(path), "gsm8k")
    assert _error(excinfo) == (
        f"{path}: missing column(s) answer for format 'gsm8k' (found ['question']; "
        "GSM8K needs question, answer; verl needs prompt, data_source, reward_model)"
    )


def test_later_jsonl_row_missing_column(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(GSM8K_ROWS[0]) + "\n" + json.dumps({"question": "x"}) + "\n")
    with pytest.raises(DataError) as excinfo:
        load_samples(str(path))
    assert _error(excinfo) == f"{path}:2: row is missing answer (every gsm8k row needs question, answer)"


def test_gsm8k_answer_without_marker(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    write_gsm8k_jsonl([{"question": "q", "answer": "the answer is 7"}], path)
    with pytest.raises(DataError) as excinfo:
        load_samples(str(path))
    assert _error(excinfo) == (
        f"{path}:1: GSM8K answer has no '#### <answer>' line (end every answer with '#### <final answer>')"
    )


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text("\n")
    with pytest.raises(DataError) as excinfo:
        load_samples(str(path))
    assert _error(excinfo) == f"{path}: file has no rows (point data.train_files at a non-empty dataset)"


def test_corrupt_parquet(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    path.write_bytes(b"definitely not parquet")
    with pytest.raises(DataError) as excinfo:
        load_samples(str(path))
    message = _error(excinfo)
    assert message.startswith(f"could not read parquet file {path}: ")
    assert message.endswith("(check the file is a valid parquet table)")


def test_verl_prompt_must_be_messages(tmp_path: Path) -> None:
    path = tmp_path / "verl.jsonl"
    row = {"data_source": "gsm8k", "prompt": "2+2?", "reward_model": {"ground_truth": "4"}}
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError) as excinfo:
        load_samples(str(path))
    assert _error(excinfo) == (
        f"{path}:1: prompt must be a list of chat messages (e.g. [{{'role': 'user', 'content': '...'}}])"
    )


def test_verl_reward_model_without_ground_truth(tmp_path: Path) -> None:
    path = tmp_path / "verl.jsonl"
    row = {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "q"}], "reward_model": {}}
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError) as excinfo:
        load_samples(str(path))
    assert _error(excinfo) == (
        f"{path}:1: reward_model has no ground_truth "
        "(set reward_model to {'style': 'rule', 'ground_truth': ...})"
    )


def test_search_r1_rows_a_reward_could_not_read_are_one_line_at_load(tmp_path: Path) -> None:
    """An empty prompt list and a ground truth without 'target' stopped a run with a traceback at the step that
    drew the row (the second only once a sampled answer reached the reward)."""
    from alignrl.data.prompts import load_task_data
    from alignrl.config import load_config

    def rows(truth, empty: int | None = None) -> list[dict]:
        out = [{"data_source": "nq", "prompt": [{"role": "user", "content": "Who?"}],
                "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"i": 1}} for _ in range(3)]
        if empty is not None:
            out[empty]["prompt"] = []
        return out

    for name, table, said in (
            ("gt", rows({"answer": ["x"]}), "row 0: ground_truth dict has no 'target' key (keys: ['answer']); "
             "Search-R1's QA rewards read reward_model.ground_truth as {'target': [...]}, a list or a string"),
            ("empty", rows({"target": ["x"]}, empty=1), "row 1: prompt is an empty list of chat messages; give every "
             "row a prompt, or drop the row")):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(table), path)
        with pytest.raises(DataError) as excinfo:
            load_task_data(load_config(None, [f"data.train_files={path}", f"data.val_files={path}"]))
        assert _error(excinfo) == f"{path} {said}"
    path = tmp_path / "gt.parquet"  # a user's reward function reads its ground truth as it likes
    load_task_data(load_config(None, [f"data.train_files={path}", f"data.val_files={path}",
                                      "algorithm.reward_fn=src/alignrl/examples/length_cost.py:compute_score"]))


def test_unknown_format_name(tmp_path: Path) -> None:
    with pytest.raises(DataError) as excinfo:
        load_samples(str(tmp_path / "x.jsonl"), "alpaca")
    assert _error(excinfo) == "unknown data format 'alpaca' (use 'auto', 'gsm8k' or 'verl')"


SEARCH_R1_ROW = {  # Search-R1's nq_search.py layout
    "data_source": "nq",
    "prompt": [{"role": "user", "content": "Answer the given question. Question: capital of France?"}],
    "ability": "fact-reasoning",
    "reward_model": {"style": "rule", "ground_truth": {"target": ["Paris", "Paris, France"]}},
    "extra_info": {"split": "train", "index": 0},
}


@pytest.mark.parametrize("writer", ["parquet", "jsonl"])
def test_structured_ground_truth_reaches_reward_as_structure(tmp_path: Path, writer: str) -> None:
    from alignrl.rewards.registry import default_compute_score

    rows = [SEARCH_R1_ROW]
    if writer == "jsonl":
        path = tmp_path / "nq.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        path = tmp_path / "nq.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    sample = load_samples(str(path))[0]
    assert sample.ground_truth == {"target": ["Paris", "Paris, France"]}
    assert type(sample.ground_truth["target"]) is list
    assert default_compute_score("nq", "<answer> paris, france </answer>", sample.ground_truth) == 1.0
    assert default_compute_score("nq", "<answer>Lyon</answer>", sample.ground_truth) == 0.0


def test_list_ground_truth_and_pandas_numpy_rows(tmp_path: Path) -> None:
    import numpy as np

    from alignrl.data.loaders import plain_ground_truth

    # numpy arrays, as parquet read through pandas/datasets gives for list cells
    assert plain_ground_truth(np.array(["a", "b"])) == ["a", "b"]
    assert plain_ground_truth({"target": np.array(["a"]), "extra": None}) == {"target": ["a"], "extra": None}
    assert plain_ground_truth(np.int64(72)) == "72"  # scalars stay text, as GSM8K/MATH rewards compare
    assert plain_ground_truth(72) == "72"
    path = tmp_path / "list.jsonl"
    path.write_text(json.dumps({**SEARCH_R1_ROW, "reward_model": {"ground_truth": ["x", "y"]}}) + "\n")
    assert load_samples(str(path))[0].ground_truth == ["x", "y"]


def test_structured_ground_truth_survives_write_verl_parquet(tmp_path: Path) -> None:
    path = tmp_path / "out.parquet"
    sample = Sample(messages=[{"role": "user", "content": "q"}], ground_truth={"target": ["a", "b"]},
                    data_source="nq")
    write_verl_parquet([sample], path)
    assert load_samples(str(path))[0] == sample


def test_truncation_keeps_the_end_the_start_or_both_halves():
    """verl's data.truncation: left keeps the last tokens, right the first, middle the first and last halves."""
    from alignrl.data.collate import truncate

    ids = list(range(10))
    assert truncate(ids, 4, "left") == [6, 7, 8, 9]
    assert truncate(ids, 4, "right") == [0, 1, 2, 3]
    assert truncate(ids, 5, "middle") == [0, 1, 7, 8, 9]
    assert truncate(ids, 20, "middle") == ids
