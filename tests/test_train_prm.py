"""`alignrl train prm`: both row layouts read into the same tokens, max_length keeping whole steps, a run that
raises held-out step accuracy on a learnable task (measured before and after) and whose saved folder scores steps,
the global step mean under gradient accumulation, OpenRLHF's and TRL's flags, and mistakes as one line."""

import json
import random
from pathlib import Path

import pytest
import torch

from alignrl.data.loaders import DataError
from alignrl.config import ConfigError
from alignrl.data.prm_rows import PRMKeys, collate_rows, encode_rows, load_rows, read_row
from alignrl.preference.prm_cli import parse_prm, prm_main

P = "@"  # one token of the tiny test tokenizer (which has no "ки": four byte tokens there)
TOKENS = ["+", "-"]


def _write(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _tok(folder):
    from alignrl.models.loader import load_tokenizer

    return load_tokenizer(folder, chat=False)


def test_both_layouts_read_into_the_same_tokens_and_labels(tiny_model_dir, tmp_path):
    tok = _tok(tiny_model_dir)
    pid = tok.encode(P, add_special_tokens=False)[0]
    text = _write(tmp_path / "text.jsonl", [{"input": f"Tom has 3 apples. 3 + 2 = 5 {P}\n5 - 1 = 3 {P}\n",
                                             "label": ["+", "-"]}])
    stepwise = _write(tmp_path / "steps.jsonl", [{"prompt": "Tom has 3 apples. ", "completions": ["3 + 2 = 5 ",
                                                                                                   "5 - 1 = 3 "],
                                                  "labels": [True, 0.25]}])
    a = load_rows(text, PRMKeys(label="label"), P, TOKENS)
    b = load_rows(stepwise, PRMKeys(), P, TOKENS)
    assert a[0].pieces == b[0].pieces  # the stepwise row in the placeholder form: step, placeholder, separator
    assert a[0].targets == ((1.0, 0.0), (0.0, 1.0)) and b[0].targets == ((1.0, 0.0), (0.25, 0.75))
    (enc,), notes = encode_rows(tok, a, pid, 64)
    assert [enc.ids[s] for s in enc.steps] == [pid, pid] and notes["truncated_rows"] == notes["piece_rows"] == 0
    (same,), _ = encode_rows(tok, b, pid, 64)  # the stepwise row, piece by piece: the same ids in this tokenizer
    assert same.ids == enc.ids and same.steps == enc.steps
    batch = collate_rows([enc], tok.pad_token_id, 2, 2.0, last_only=True)
    assert batch.step_mask.sum() == 1 and batch.step_mask[0, enc.steps[1]]  # TRL's train_on_last_step_only
    assert batch.targets[0, enc.steps[1]].tolist() == [0.0, 1.0] and batch.total_steps == 2.0


def _llama_tokenizer():
    """transformers' LlamaTokenizer (Llama-2 / Mistral's layout: Metaspace, a '▁' put before a text's first word) over
    a BPE vocabulary trained here on two lines."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace("▁", prepend_scheme="always", split=True),
                                                 pre_tokenizers.Split("\n", "isolated")])
    bpe.train_from_iterator([LLAMA_TEXT, "+ - ки"], trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    model = json.loads(bpe.to_str())["model"]
    return LlamaTokenizer(vocab=model["vocab"], merges=[tuple(m) if isinstance(m, list) else tuple(m.split(" "))
                                                        for m in model["merges"]])


LLAMA_TEXT = "Step 1: 3 + 2 = 5 ки\nStep 2: 5 - 1 = 4 ки\n"


class _Recorder(torch.nn.Module):
    """A stand-in causal LM that keeps the ids it is given (zero logits over `vocab`)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.seen, self.w = vocab, [], torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, use_cache=False):
        self.seen.append(input_ids[0].tolist())
        return type("Out", (), {"logits": torch.zeros(*input_ids.shape, self.vocab)})()


def test_text_rows_are_tokenised_whole_as_openrlhf_and_a_scorer_read_them():
    """Piece by piece, a sentencepiece-style tokenizer puts a '▁' before every piece (' ки' became '▁', '▁ки',
    '▁'): a text row is tokenised whole, and piece by piece only where its placeholders are not one per label."""
    from alignrl.preference.prm import score_steps, token_ids

    tok = _llama_tokenizer()
    pid, _ = token_ids(tok, "ки", TOKENS)
    keys = PRMKeys(label="label")
    rows = [read_row("a:1", {"input": LLAMA_TEXT, "label": ["+", "-"]}, keys, "ки", TOKENS),
            read_row("a:2", {"input": "Step 1: 3 + 2 = 5\nки", "label": ["+"]}, keys, "ки", TOKENS)]
    (whole, merged), notes = encode_rows(tok, rows, pid, 64)
    assert whole.ids == tok.encode(LLAMA_TEXT, add_special_tokens=False) and whole.steps == [7, 16]
    assert "▁" not in tok.convert_ids_to_tokens(whole.ids)  # no stray '▁' around the placeholders
    # after a newline "ки" is the token 'ки', not the placeholder '▁ки': that row goes piece by piece, counted
    assert notes["piece_rows"] == 1 and [merged.ids[s] for s in merged.steps] == [pid]
    model = _Recorder(len(tok))
    assert score_steps(model, tok, [LLAMA_TEXT], "ки", TOKENS) == [[0.5, 0.5]] and model.seen == [whole.ids]
    steps = read_row("a:3", {"prompt": "", "completions": ["Step 1: 3 + 2 = 5 "], "label": [True]}, keys, "ки",
                     TOKENS)
    (enc,), notes = encode_rows(tok, [steps], pid, 64)  # stepwise: piece by piece, as TRL tokenises each step
    alone = [tok.encode(t, add_special_tokens=False) for t in ("Step 1: 3 + 2 = 5 ", "\n")]
    assert notes["piece_rows"] == 0 and enc.ids == alone[0] + [pid] + alone[1]


def test_max_length_keeps_whole_steps_and_counts_the_labels_dropped(tiny_model_dir, tmp_path):
    tok = _tok(tiny_model_dir)
    pid = tok.encode(P, add_special_tokens=False)[0]
    rows = load_rows(_write(tmp_path / "d.jsonl", [{"prompt": "q", "completions": ["1 + 1 = 2", "2 + 2 = 4",
                                                                                    "4 + 4 = 8"],
                                                    "labels": ["+", "+", "-"]}]), PRMKeys(), P, TOKENS)
    (full,), _ = encode_rows(tok, rows, pid, 256)
    cut_at = full.steps[1] + 3  # inside the third step
    (cut,), notes = encode_rows(tok, rows, pid, cut_at)
    assert cut.ids == full.ids[:full.steps[1] + 1] and cut.steps == full.steps[:2] and len(cut.targets) == 2
    assert notes == {"truncated_rows": 1, "dropped_labels": 1, "dropped_rows": 0, "piece_rows": 0}
    none, notes = encode_rows(tok, rows, pid, full.steps[0])  # not even the first step fits: the row goes
    assert none == [] and notes["dropped_rows"] == 1 and notes["dropped_labels"] == 3


def _row(rng: random.Random, n: int) -> tuple[list[str], list[bool]]:
    """A learnable task: a step saying `loses` is right, one saying `gives` wrong."""
    good = [rng.random() < 0.5 for _ in range(n)]
    return [f"{rng.randint(1, 9)} {'loses' if g else 'gives'}" for g in good], good


def _text_rows(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        steps, good = _row(rng, 2 + i % 3)
        out.append({"input": "Sam has 9 apples. " + "".join(f"{s}{P}\n" for s in steps),
                    "label": ["+" if g else "-" for g in good]})
    return out


def _run(model: Path, tmp: Path, name: str, *extra: str) -> dict:
    rc = prm_main([f"model_path={model}", "--output_dir", str(tmp / name), "--logging_dir", str(tmp / f"logs_{name}"),
                   "report_to=[jsonl]", "log_every=1", f"placeholder_token={P}", "bf16=false", *extra])
    assert rc == 0
    return json.loads((tmp / name / "eval_results.json").read_text())


def test_training_raises_held_out_step_accuracy_and_the_folder_scores_steps(tiny_model_dir, tmp_path):
    from alignrl.preference.prm import load_scorer, score_steps

    train = _write(tmp_path / "train.jsonl", _text_rows(0, 48))
    held = _write(tmp_path / "eval.jsonl", _text_rows(1, 12))
    res = _run(tiny_model_dir, tmp_path, "prm", f"train_files=[{train}]", f"eval_files=[{held}]", "label_key=label",
               "batch_size=8", "epochs=6", "learning_rate=1e-2", "warmup_ratio=0",
               "lr_scheduler=constant")
    before, after = res["before"], res["after"]
    assert res["steps"] == 36 and after["steps"] == before["steps"] == 36
    assert after["step_accuracy"] >= 0.9 and after["step_accuracy"] > before["step_accuracy"] + 0.2
    assert after["loss"] < before["loss"]
    rows = [json.loads(line) for line in (tmp_path / "logs_prm" / "metrics.jsonl").read_text().splitlines()]
    assert {"loss", "acc"} <= set().union(*rows)
    folder = tmp_path / "prm"
    model, tok, placeholder, tokens = load_scorer(folder)  # a causal-LM folder plus the tokens a scorer needs
    assert (placeholder, tokens) == (P, TOKENS) and not model.training
    scores = score_steps(model, tok, [f"Sam has 9 apples. 2 loses{P}\n4 gives{P}\n"], P, TOKENS)
    assert len(scores[0]) == 2 and scores[0][0] > 0.5 > scores[0][1]


def _stepwise_rows(count: int) -> list[dict]:
    rng = random.Random(3)
    rows = []
    for i in range(count):
        steps, good = _row(rng, 2 + i % 3)
        rows.append({"prompt": "Sam has 9 apples. ", "completions": steps, "labels": [0.9 if g else 0.1 for g in good]})
    return rows


def test_accumulated_micro_batches_give_the_gradient_of_the_whole_steps_mean(tiny_model_dir, tmp_path):
    """Rows of 2 to 4 steps: two accumulated micro-batches of 2 rows give the gradient of one batch of 4, the mean
    over the optimizer step's steps (every step weighs the same), not a mean of micro-batch means."""
    from alignrl.models.loader import load_causal_lm
    from alignrl.preference.prm import _loss_fn, _encode, train_batches
    from alignrl.runtime.env import DistEnv

    data = _write(tmp_path / "steps.jsonl", _stepwise_rows(4))
    tok, env = _tok(tiny_model_dir), DistEnv()
    model = load_causal_lm(tiny_model_dir, "float32", "model_path").eval()

    def grads(*extra: str) -> tuple[list[torch.Tensor], list[float]]:
        cfg = parse_prm([f"train_files=[{data}]", f"placeholder_token={P}", "bf16=false", *extra])
        rows = load_rows(data, PRMKeys(), P, TOKENS)
        enc, _, _, rids, _ = _encode(tok, cfg, rows, [], _Quiet())
        model.zero_grad()
        shares = []
        for batch in train_batches(enc, tok.pad_token_id, 2, cfg, env)(0):
            loss, m = _loss_fn(cfg, env, rids)(model, batch, 4.0)
            loss.backward()
            shares.append(m["loss"])
        return [p.grad.clone() for p in model.parameters()], shares

    whole, (loss,) = grads("batch_size=4")
    parts, shares = grads("batch_size=2", "gradient_accumulation_steps=2")
    assert len(shares) == 2 and shares[0] != shares[1]
    assert sum(shares) / 2 == pytest.approx(loss, rel=1e-5)  # the logged step loss: the step mean either way
    for a, b in zip(whole, parts):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)


def test_stepwise_rows_with_soft_labels_train(tiny_model_dir, tmp_path, capsys):
    from safetensors.torch import load_file

    data = _write(tmp_path / "steps.jsonl", _stepwise_rows(8))
    res = _run(tiny_model_dir, tmp_path, "soft", f"train_files=[{data}]", "batch_size=4", "max_steps=1",
               "learning_rate=1e-3", "train_on_last_step_only=true")
    assert res["steps"] == 1 and res["reward_tokens"] == TOKENS
    assert (res["train_steps"], res["train_labelled_steps"]) == (8, 23)  # the last step of each of 8 rows trains
    out = capsys.readouterr().out
    assert "8 train rows (23 labelled steps, 8 trained: train_on_last_step_only)" in out
    assert "loss: cross-entropy over the reward tokens + - (ids " in out  # which loss runs, said at start
    trained, base = (load_file(str(f / "model.safetensors")) for f in (tmp_path / "soft", Path(tiny_model_dir)))
    assert any(not torch.equal(trained[k], base[k]) for k in base)


class _Quiet:
    def print(self, *_):
        pass


def test_openrlhf_and_trl_flags_read_as_keys(capsys):
    cfg = parse_prm(["--pretrain", "demo", "--dataset", "a.jsonl,b.jsonl", "--input_key", "text", "--label_key",
                     "value", "--placeholder_token", "ки", "--reward_tokens", "+", "-", "--max_len", "512",
                     "--micro_train_batch_size", "2"])
    assert (cfg.train_files, cfg.input_key, cfg.label_key, cfg.placeholder_token, cfg.reward_tokens) == (
        ["a.jsonl", "b.jsonl"], "text", "value", "ки", ["+", "-"])
    assert (cfg.max_length, cfg.batch_size, cfg.learning_rate) == (512, 2, 1e-6)  # train_prm's learning rate
    assert "reward_tokens=None" not in capsys.readouterr().err
    # OpenRLHF's line without --reward_tokens: its loss over the whole vocabulary (reward_tokens=[]), said once
    assert parse_prm(["--pretrain", "demo", "--dataset", "a.jsonl"]).reward_tokens == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "OpenRLHF's train_prm defaults where the line is silent: " in err
    assert err.rstrip().endswith(", reward_tokens=[]") and "reward_tokens=None" not in err, err
    with pytest.raises(ConfigError, match=r"reward_tokens=\[True, False\]: YAML read True as bool, not a text .* "
                                          "quote each token"):
        parse_prm(["train_files=[a.jsonl]", "reward_tokens=[yes,no]"])
    assert parse_prm(["train_files=[a.jsonl]", 'reward_tokens=["yes","no"]']).reward_tokens == ["yes", "no"]
    trl = parse_prm(["--model_name_or_path", "demo", "--dataset_name", "s.jsonl", "--step_separator", " | ",
                     "--train_on_last_step_only", "--reward_tokens=good,bad"])
    assert (trl.step_separator, trl.train_on_last_step_only, trl.reward_tokens, trl.learning_rate) == (
        " | ", True, ["good", "bad"], 1e-5)
    assert (trl.label_key, trl.completions_key, trl.max_length) == ("labels", "completions", 1024)


def test_mistakes_are_one_line(tiny_model_dir, tmp_path, capsys):
    from conftest import one_line

    def err(*argv: str) -> str:
        assert prm_main([f"model_path={tiny_model_dir}", "--output_dir", str(tmp_path / "out"), *argv]) == 2
        return one_line(capsys.readouterr().err)

    ok = _write(tmp_path / "ok.jsonl", [{"input": r["input"].replace(P, "ки"), "label": r["label"]}
                                        for r in _text_rows(0, 8)])
    assert "is 4 tokens in this tokenizer, not one; pick a text that is one token, or add it to the tokenizer as a " \
           "special token" in err(f"train_files=[{ok}]", "label_key=label")  # the default placeholder "ки"
    bad = _write(tmp_path / "bad.jsonl", [{"input": f"a {P} b {P}", "label": ["+"]}])
    assert err(f"train_files=[{bad}]", "label_key=label", f"placeholder_token={P}").endswith(
        f"bad.jsonl:1: 2 placeholders ('{P}') in input but 1 labels in label; each step ends in one placeholder and "
        "has one label")
    odd = _write(tmp_path / "odd.jsonl", [{"prompt": "q", "completions": ["a", "b"], "labels": [True, "?"]}])
    assert "odd.jsonl:1: label '?' of labels is not one of the reward tokens + -" in err(
        f"train_files=[{odd}]", f"placeholder_token={P}")
    uneven = _write(tmp_path / "uneven.jsonl", [{"prompt": "q", "completions": ["a", "b"], "labels": [True]}])
    assert "uneven.jsonl:1: 2 steps in completions but 1 labels" in err(f"train_files=[{uneven}]",
                                                                        f"placeholder_token={P}")
    assert "reward_tokens=['+'] must be two or more different tokens" in err("train_files=[x.jsonl]",
                                                                              "reward_tokens=[+]")
    with pytest.raises(DataError, match="a number label .* needs exactly two reward tokens, not 3"):
        load_rows(_write(tmp_path / "s.jsonl", [{"input": f"a {P}", "labels": [0.5]}]), PRMKeys(), P, ["a", "b", "c"])
