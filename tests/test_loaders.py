"""Dataset loading: both formats, both file types, auto-detection, and the user-facing errors."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from alignrl.data.loaders import (
    DataError,
    count_rows,
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
    path = tmp_path / "train.csv"
    path.write_text("question,answer\n")
    with pytest.raises(DataError) as excinfo:
        load_samples(str(path))
    assert _error(excinfo) == f"unsupported data file extension '.csv' for {path} (use .jsonl, .json or .parquet)"


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


# --- by column (data.prompt_key / OpenRLHF's --input_key) ---------------------------------------------

OPENRLHF_ROWS = [{"messages": [{"role": "user", "content": "What is 6 * 7?"}], "answer": 42},
                 {"messages": [{"role": "user", "content": "What is 1 + 1?"}], "answer": "2", "data_source": "gsm8k"}]


def test_messages_column_with_the_chat_template(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in OPENRLHF_ROWS))
    samples = load_samples(str(path), prompt_key="messages", label_key="answer", system_prompt="Be brief.")
    assert samples[0] == Sample(messages=[{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "What is 6 * 7?"}],
                                ground_truth="42", data_source="math")  # no data_source column: the math rule
    assert (samples[1].ground_truth, samples[1].data_source, samples[1].prompt_text) == ("2", "gsm8k", None)
    assert samples[1].source == f"{path}:2"


def test_string_column_with_an_input_template_is_not_chat_templated(tmp_path: Path) -> None:
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist([{"input": "What is 6 * 7?", "label": "42"}]), path)
    [s] = load_samples(str(path), prompt_key="input", label_key="label", input_template="User: {}\nAssistant: ",
                       apply_chat_template=False)
    assert s.prompt_text == "User: What is 6 * 7?\nAssistant: " and s.ground_truth == "42"
    assert s.messages == [{"role": "user", "content": "What is 6 * 7?"}]  # still readable as a question
    [raw] = load_samples(str(path), prompt_key="input", label_key="label", apply_chat_template=False)
    assert raw.prompt_text == "What is 6 * 7?"
    [chat] = load_samples(str(path), prompt_key="input")  # a string prompt becomes one user turn
    assert chat.prompt_text is None and chat.messages == raw.messages
    assert chat.ground_truth == "" and chat.data_source == "math"  # no label: the reward model scores it


def test_untemplated_prompts_are_tokenized_as_they_are(tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    from alignrl.data.collate import encode_prompts

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    raw = Sample(messages=[{"role": "user", "content": "1 + 1"}], ground_truth="2", prompt_text="Q: 1 + 1\nA:")
    chat = Sample(messages=raw.messages, ground_truth="2")
    ids = encode_prompts(tok, [raw, chat], 1000)
    assert ids[0] == tok("Q: 1 + 1\nA:", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids[0]) == "Q: 1 + 1\nA:"
    assert len(ids[1]) > len(tok("1 + 1")["input_ids"]) and ids[1] != ids[0]  # the chat template's tokens
    assert encode_prompts(tok, [raw], 3)[0] == ids[0][-3:]  # truncated from the left, as templated prompts


def test_json_array_and_json_lines_load(tmp_path: Path) -> None:
    array = tmp_path / "array.json"
    array.write_text(json.dumps(OPENRLHF_ROWS, indent=2))
    lines = tmp_path / "lines.json"
    lines.write_text("".join(json.dumps(r) + "\n" for r in OPENRLHF_ROWS))
    a = load_samples(str(array), prompt_key="messages", label_key="answer")
    b = load_samples(str(lines), prompt_key="messages", label_key="answer", limit=1)
    assert [s.ground_truth for s in a] == ["42", "2"] and a[1].source == f"{array} row 1"
    assert b == a[:1] and b[0].source == f"{lines}:1"
    assert count_rows(str(array)) == 2 and count_rows(str(lines)) == 2
    gsm8k = tmp_path / "gsm8k.json"  # the detected layouts read .json too
    gsm8k.write_text(json.dumps(GSM8K_ROWS))
    assert [s.ground_truth for s in load_samples(str(gsm8k))] == ["7", "1234"]


def test_verl_rows_read_by_column_keep_their_reward(tmp_path: Path) -> None:
    path = tmp_path / "verl.parquet"
    write_verl_parquet([Sample([{"role": "user", "content": "q"}], "3", "lighteval/MATH", {"k": "v"})], path)
    [s] = load_samples(str(path), prompt_key="prompt")  # verl's data.prompt_key=prompt
    assert s == load_samples(str(path))[0]


@pytest.mark.parametrize("rows, keys, words", [
    ([{"messages": "a", "answer": "1"}, {"messages": "b"}], {"label_key": "answer"},
     "row 1: row has no 'answer' value (data.label_key names the answer column"),
    ([{"messages": "a", "answer": None}], {"label_key": "answer"}, "row 0: row has no 'answer' value"),
    ([{"question": "a"}], {}, "row 0: row has no 'messages' column (data.prompt_key names the prompt column"),
    ([{"messages": 3}], {}, "row 0: messages is a int, not a string or a list of chat messages"),
    ([{"messages": [{"role": "user"}]}], {}, "row 0: messages message {'role': 'user'} lacks role/content"),
    ([{"messages": [{"role": "user", "content": "a"}]}], {"apply_chat_template": False},
     "row 0: messages holds chat messages, which need the chat template (set data.apply_chat_template=true"),
])
def test_by_column_errors_name_the_row(rows, keys, words, tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(rows))
    with pytest.raises(DataError) as excinfo:
        load_samples(str(path), prompt_key="messages", **keys)
    assert _error(excinfo).startswith(f"{path} {words}"), _error(excinfo)


def test_bad_json_array_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('[{"a": 1},\n 2]')
    with pytest.raises(DataError) as excinfo:
        load_samples(str(path), prompt_key="a")
    assert _error(excinfo).startswith(f"{path} row 1: a JSON int, not an object")
    path.write_text('[{"a": 1},')
    with pytest.raises(DataError) as excinfo:
        load_samples(str(path), prompt_key="a")
    assert _error(excinfo).startswith(f"{path}: not valid JSON")


@pytest.mark.parametrize("over, words", [
    (["data.input_template=Q", "data.apply_chat_template=false"], "has no {} where the prompt goes"),
    (["data.input_template='{} {x}'", "data.apply_chat_template=false"], "has braces other than one {}"),
    (["data.input_template='Q: {}'"], "data.input_template is used only with data.apply_chat_template=false"),
    (["data.apply_chat_template=false", "data.system_prompt=hi"], "data.system_prompt is a chat message"),
    (["data.format=gsm8k"], "data.format=gsm8k and data.prompt_key name the layout twice"),
])
def test_prompt_key_config_checks(over, words) -> None:
    from alignrl.config import ConfigError, load_config

    with pytest.raises(ConfigError) as excinfo:
        load_config(None, ["data.prompt_key=input", *over])
    assert words in str(excinfo.value) and "\n" not in str(excinfo.value), str(excinfo.value)
    with pytest.raises(ConfigError, match="applies to files read by column: set data.prompt_key"):
        load_config(None, ["data.label_key=answer"])
    assert load_config(None, ["data.prompt_key=q", "data.input_template='Q: {}'",
                              "data.apply_chat_template=false"]).data.input_template == "Q: {}"


def test_grpo_trains_a_step_on_a_messages_json_file(tiny_model_dir, tmp_path: Path) -> None:
    """`alignrl train grpo` on OpenRLHF-style rows ({messages, answer}) named by data.prompt_key/label_key."""
    import os
    import subprocess
    import sys

    rows = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": a + b}
            for a, b in ((1, 2), (3, 4), (5, 6), (7, 8), (2, 2))]
    data = tmp_path / "prompts.json"
    data.write_text(json.dumps(rows))
    # the reward sees each row's label as the ground truth and the math rule's data_source: 1.0 on every row
    reward = tmp_path / "reward.py"
    reward.write_text("def score(data_source, solution, ground_truth, extra_info=None):\n"
                      "    return float(data_source == 'math' and ground_truth in ('3', '7', '11', '15', '4'))\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "alignrl", "train", "grpo", f"model.path={tiny_model_dir}", f"data.train_files={data}",
         f"data.val_files={data}", "data.prompt_key=messages", "data.label_key=answer", "data.train_batch_size=2",
         "data.val_size=3", "rollout.n=2", "rollout.max_new_tokens=4", "actor.ppo_mini_batch_size=2",
         "actor.ppo_micro_batch_size=4", "trainer.total_training_steps=1", "trainer.save_freq=0",
         f"algorithm.reward_fn={reward}:score", "trainer.threads=1", "trainer.progress_bar=false",
         "trainer.logger=[jsonl]",
         f"trainer.output_dir={tmp_path}", "trainer.experiment_name=keys"],
        capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "keys" / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["heldout_problems"] == 3
    metrics = [json.loads(x) for x in (tmp_path / "keys" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1] and metrics[1]["reward/mean"] == 1.0
    assert metrics[0]["val/accuracy"] == summary["final_accuracy"] == 1.0
