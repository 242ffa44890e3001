"""Loading prompts by column (data.prompt_key / label_key, OpenRLHF's --input_key / --label_key): JSON lines,
JSON arrays and parquet, chat-templated or not, the errors that name the row, and a GRPO step on such a file."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from alignrl.data.loaders import DataError, count_rows, load_samples, write_verl_parquet
from alignrl.data.records import Sample
from test_loaders import GSM8K_ROWS, _error
from conftest import src_path


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


def test_the_readme_input_template_as_the_shell_passes_it(tmp_path: Path, capsys) -> None:
    """`data.input_template=$'User: {}\\nAssistant: '` reaches the program with braces and a newline in it: the text
    key takes it as text (YAML read `User: {}` as a mapping). Typed as `'User: {}\\nAssistant: '` it holds the two
    characters backslash-n, kept as they are (a template may hold LaTeX such as \\nabla), with a warning."""
    from alignrl.data.prompts import load_task_data
    from alignrl.config import load_config

    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"input": "What is 6 * 7?", "label": "42"}) + "\n")
    base = [f"data.train_files={path}", f"data.val_files={path}", "data.prompt_key=input", "data.label_key=label",
            "data.apply_chat_template=false"]
    cfg = load_config(None, [*base, "data.input_template=User: {}\nAssistant: "])
    train, _ = load_task_data(cfg)
    assert train[0].prompt_text == "User: What is 6 * 7?\nAssistant: "
    assert "not a newline" not in capsys.readouterr().out
    cfg = load_config(None, [*base, "data.input_template=User: {}\\nAssistant: "])
    assert load_task_data(cfg)[0][0].prompt_text == "User: What is 6 * 7?\\nAssistant: "
    assert "data.input_template holds the two characters \\n, not a newline" in capsys.readouterr().out


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
    env = {**os.environ, "PYTHONPATH": src_path(), "OMP_NUM_THREADS": "1"}
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
