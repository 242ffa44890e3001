"""`alignrl train prm` with OpenRLHF's whole-vocabulary loss (`reward_tokens=[]`, its --reward_tokens unset): a line
in OpenRLHF's spelling without --reward_tokens trains it, held-out step accuracy over the vocabulary rises, the saved
folder scores steps by its labels (the positive one first, or named where the labels do not tell), and labels that
need reward tokens are one line."""

import json
import re
from pathlib import Path

import pytest

from alignrl.config import ConfigError
from alignrl.data.loaders import DataError
from alignrl.data.prm_rows import PRMKeys, distinct_labels, load_rows, over_label_tokens, positive_first
from alignrl.preference.prm_cli import parse_prm, prm_main
from test_train_prm import P, _text_rows, _write


def _their_line(model: Path, tmp: Path, name: str, *extra: str) -> list[str]:
    """A train_prm line in OpenRLHF's spelling, naming no reward tokens."""
    return ["--pretrain", str(model), "--save_path", str(tmp / name), "--logging_dir", str(tmp / f"logs_{name}"),
            "--placeholder_token", P, "--label_key", "label", "report_to=[jsonl]", *extra]


def test_openrlhf_line_without_reward_tokens_trains_the_vocabulary_and_the_folder_scores(tiny_model_dir, tmp_path,
                                                                                          capsys):
    from alignrl.preference.prm import load_scorer, score_steps

    train = _write(tmp_path / "train.jsonl", _text_rows(0, 48))
    held = _write(tmp_path / "eval.jsonl", _text_rows(1, 12))
    assert prm_main(_their_line(tiny_model_dir, tmp_path, "vocab", "--dataset", train, "--eval_dataset", held,
                                "--micro_train_batch_size", "8", "--train_batch_size", "8", "--max_epochs", "6",
                                "--learning_rate", "1e-2", "--lr_warmup_ratio", "0", "lr_scheduler=constant",
                                "eval_strategy=no")) == 0
    out = capsys.readouterr()
    assert "OpenRLHF's train_prm defaults where the line is silent: " in out.err and "reward_tokens=[]" in out.err
    assert "loss: cross-entropy over the whole vocabulary at each placeholder (reward_tokens=[]" in out.out
    res = json.loads((tmp_path / "vocab" / "eval_results.json").read_text())
    before, after = res["before"], res["after"]
    assert res["steps"] == 36 and after["steps"] == before["steps"] == 36
    assert (res["loss_type"], res["reward_tokens"], res["positive_label"]) == ("whole_vocabulary", ["+", "-"], "+")
    # over the whole vocabulary an untrained model's arg-max is almost never the label token; trained, it is
    assert after["step_accuracy"] >= 0.85 and after["step_accuracy"] > before["step_accuracy"] + 0.5
    assert after["loss"] < before["loss"] - 1.0
    spec = json.loads((tmp_path / "vocab" / "prm_tokens.json").read_text())
    assert (spec["loss"], spec["reward_tokens"], spec["positive_label"]) == ("whole_vocabulary", ["+", "-"], "+")
    model, tok, placeholder, tokens = load_scorer(tmp_path / "vocab")
    assert (placeholder, tokens) == (P, ["+", "-"])
    scores = score_steps(model, tok, [f"Sam has 9 apples. 2 loses{P}\n4 gives{P}\n"], P, tokens)
    assert len(scores[0]) == 2 and scores[0][0] > 0.5 > scores[0][1]


def test_labels_that_do_not_tell_the_positive_one_are_named_for_scoring(tiny_model_dir, tmp_path, capsys):
    from alignrl.preference.prm import load_scorer, score_steps

    rows = [{"input": r["input"], "label": ["x" if t == "+" else "y" for t in r["label"]]} for r in _text_rows(2, 8)]
    data = _write(tmp_path / "xy.jsonl", rows)
    assert prm_main([f"model_path={tiny_model_dir}", "--output_dir", str(tmp_path / "xy"), "--logging_dir",
                     str(tmp_path / "logs_xy"), "report_to=[jsonl]", f"placeholder_token={P}", "label_key=label",
                     f"train_files=[{data}]", "reward_tokens=[]", "batch_size=4", "max_steps=1", "bf16=false"]) == 0
    seen = " ".join(dict.fromkeys(t for r in rows for t in r["label"]))  # the labels in order of appearance
    assert f"note: the labels {seen} do not tell which is the positive one: name it for scoring" in \
        capsys.readouterr().out
    with pytest.raises(ConfigError, match=f"the labels {seen} do not tell which is the positive one; name them for "
                                          r"scoring, positive first: load_scorer\(folder, reward_tokens=\[...\]\)"):
        load_scorer(tmp_path / "xy")
    for named, said in (("yx", "give a list of the label tokens"), (["good", "bad"], "names tokens this model was not "
                                                                                   "trained to put after a step")):
        with pytest.raises(ConfigError, match=said):
            load_scorer(tmp_path / "xy", reward_tokens=named)
    model, tok, placeholder, tokens = load_scorer(tmp_path / "xy", reward_tokens=["y", "x"])
    assert tokens == ["y", "x"]
    (scores,) = score_steps(model, tok, [f"Sam has 9 apples. 2 loses{P}\n"], placeholder, tokens)
    assert len(scores) == 1 and 0.0 < scores[0] < 1.0


def test_only_an_openrlhf_line_naming_no_reward_tokens_trains_the_vocabulary(tmp_path, capsys):
    theirs = ["--pretrain", "demo", "--dataset", "a.jsonl"]
    assert parse_prm(theirs).reward_tokens == []
    assert capsys.readouterr().err.rstrip().endswith(", reward_tokens=[]")  # said with their other defaults
    config = tmp_path / "prm.yaml"
    config.write_text('reward_tokens: ["good", "bad"]\n')
    for named, tokens in ((["--reward_tokens=+,-"], ["+", "-"]), (['reward_tokens=["good","bad"]'], ["good", "bad"]),
                          (["--config", str(config)], ["good", "bad"])):
        assert parse_prm(theirs + named).reward_tokens == tokens, named
        assert "reward_tokens=[]" not in capsys.readouterr().err  # the line's own reward tokens: the loss over them
    # our own keys and TRL's spelling keep [+, -]; reward_tokens=[] asks for the vocabulary in any spelling
    assert parse_prm(["train_files=[a.jsonl]"]).reward_tokens == ["+", "-"]
    assert parse_prm(["--model_name_or_path", "demo", "--dataset_name", "a.jsonl"]).reward_tokens == ["+", "-"]
    assert parse_prm(["train_files=[a.jsonl]", "reward_tokens=[]"]).reward_tokens == []
    with pytest.raises(ConfigError, match=r"reward_tokens=\['\+'\] must be two or more different tokens, the "
                                          r"positive label first \(e.g. --reward_tokens \+ -\), or \[\] for the loss "
                                          "over the whole vocabulary"):
        parse_prm(theirs + ["--reward_tokens", "+"])


def test_positive_first_orders_known_pairs_and_rows_become_one_hot_over_the_labels(tmp_path):
    assert positive_first(["-", "+"]) == (["+", "-"], "+")
    assert positive_first(["no"]) == (["yes", "no"], "yes")  # one side seen: the pair, for a scorer
    assert positive_first(["x", "+"]) == (["x", "+"], None)
    rows = load_rows(_write(tmp_path / "r.jsonl", [{"input": f"a{P} b{P}", "labels": ["-", "-"]},
                                                   {"prompt": "q", "completions": ["c"], "labels": ["+"]}]),
                     PRMKeys(), P, [])
    assert [r.labels for r in rows] == [("-", "-"), ("+",)] and [r.n_steps for r in rows] == [2, 1]
    assert distinct_labels(rows) == ["-", "+"]
    one_hot = over_label_tokens(rows, ["+", "-"])
    assert [r.targets for r in one_hot] == [((0.0, 1.0), (0.0, 1.0)), ((1.0, 0.0),)]


class _Words:
    """A tokenizer reading "-" as two tokens, every other text as one."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1, 2] if text == "-" else [1]


def test_a_known_pairs_unseen_side_is_added_for_scoring_only_where_it_is_one_token(tmp_path):
    from alignrl.preference.prm import label_tokens

    vocab = parse_prm(["train_files=[a.jsonl]", "reward_tokens=[]"])
    plus = load_rows(_write(tmp_path / "p.jsonl", [{"input": f"a{P}", "labels": ["+"]}]), PRMKeys(), P, [])
    minus = load_rows(_write(tmp_path / "m.jsonl", [{"input": f"a{P}", "labels": ["-"]}]), PRMKeys(), P, [])
    assert label_tokens(_Words(), vocab, plus) == (["+"], None)  # "-" is no single token here: not added
    assert label_tokens(_Words(), vocab, plus + minus) == (["+", "-"], "+")  # seen in the data: kept as the labels
    assert label_tokens(_Words(), vocab, minus) == (["+", "-"], "+")  # "+" is one token: the positive side added
    assert label_tokens(_Words(), parse_prm(["train_files=[a.jsonl]"]), minus) == (["+", "-"], "+")  # named ones


def _error(text: str) -> str:
    """The one error line of a run's stderr (the notes of a line in OpenRLHF's spelling come before it)."""
    errors = [line for line in text.strip().splitlines() if line.startswith("alignrl: error:")]
    assert len(errors) == 1 and "Traceback" not in text, text[-3000:]
    return errors[0]


def test_labels_needing_reward_tokens_are_one_line(tiny_model_dir, tmp_path, capsys):
    for labels, message in (([True], r"a boolean label \(True\) of labels means the first or second reward token, "
                                      r"and reward_tokens=\[\] .* names none"),
                            ([0.25], r"a number label \(0.25\) of labels is a soft label, which needs two reward "
                                     r"tokens .*: give reward_tokens, e.g. --reward_tokens \+ -")):
        with pytest.raises(DataError, match=message):
            load_rows(_write(tmp_path / "b.jsonl", [{"input": f"a{P}", "labels": labels}]), PRMKeys(), P, [])
    soft = _write(tmp_path / "soft.jsonl", [{"input": f"a{P}", "label": [0.5]}])
    assert prm_main(_their_line(tiny_model_dir, tmp_path, "soft", "--dataset", soft)) == 2
    assert "soft.jsonl:1: a number label (0.5) of label is a soft label, which needs two reward tokens" in _error(
        capsys.readouterr().err)
    long = _write(tmp_path / "long.jsonl", [{"input": f"a{P}", "label": ["good step"]}])
    assert prm_main(_their_line(tiny_model_dir, tmp_path, "long", "--dataset", long)) == 2
    assert re.search(r"reward_tokens=\[\]: the label 'good step' is \d+ tokens in this tokenizer, not one",
                     _error(capsys.readouterr().err))


def test_a_resume_under_the_other_loss_is_one_line(tiny_model_dir, tmp_path, capsys):
    """A checkpoint of the loss over the reward tokens (as every PRM checkpoint written before the whole-vocabulary
    loss was) does not go on under the whole-vocabulary loss, nor the reverse."""
    data = _write(tmp_path / "train.jsonl", _text_rows(0, 8))
    line = [f"model_path={tiny_model_dir}", "report_to=[jsonl]", f"placeholder_token={P}", "label_key=label",
            f"train_files=[{data}]", "batch_size=4", "max_steps=2", "save_steps=1", "bf16=false"]
    assert prm_main([*line, "--output_dir", str(tmp_path / "a"), "--logging_dir", str(tmp_path / "la")]) == 0
    ckpt = next((tmp_path / "a.checkpoints").glob("*_1"))
    state = json.loads((ckpt / "state.json").read_text())
    assert state["setting"] == {"loss": "reward_tokens", "label_tokens": ["+", "-"]}
    again = [*line, "--output_dir", str(tmp_path / "b"), "--logging_dir", str(tmp_path / "lb"), f"resume_from={ckpt}"]
    capsys.readouterr()
    assert prm_main([*again, "reward_tokens=[]"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "was trained with loss=reward_tokens and this line gives loss=whole_vocabulary" in err
    (ckpt / "state.json").write_text(json.dumps({"step": 1}))  # a checkpoint from before settings were recorded
    assert prm_main([*again, "reward_tokens=[]"]) == 2
    assert "was trained with loss=reward_tokens" in capsys.readouterr().err
    assert prm_main(again) == 0  # the loss it was trained with goes on
