"""`alignrl train sft` on the tiny test model: the loss falls on a memorisation task with the held-out loss reported,
the trained-token masks of each layout, gradient accumulation and packing equal to one big padded batch, exact resume
(NEFTune's noise included), max_samples over all files, LoRA's merged folder, and mistakes as one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from alignrl.config import ConfigError
from alignrl.data.loaders import DataError
from alignrl.data.sft_rows import SFTKeys, SFTRow, encode_rows, load_rows
from alignrl.preference.sft import _load
from alignrl.preference.sft_cli import parse_sft, sft_main

# completions of different lengths, so micro-batches of one step hold different numbers of trained tokens
ROWS = [{"prompt": f"count from {i}", "completion": " ".join(str(i + k) for k in range(1 + i % 4))} for i in range(16)]
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "and"}, {"role": "assistant", "content": "bye"}]


def _write(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _run(model: Path, tmp: Path, name: str, *extra: str) -> dict:
    data = _write(tmp / "train.jsonl", ROWS)
    rc = sft_main([f"model_path={model}", f"train_files=[{data}]", "--output_dir", str(tmp / name), "--logging_dir",
                   str(tmp / f"logs_{name}"), "report_to=[jsonl]", "log_every=1", *extra])
    assert rc == 0
    return json.loads((tmp / name / "eval_results.json").read_text())


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _tokenizer(model: Path):
    from alignrl.models.loader import load_tokenizer

    return load_tokenizer(model, chat=False)



class _Quiet:
    def print(self, *_):
        pass


def test_an_openrlhf_line_trains_on_openrlhfs_text(tiny_model_dir, tmp_path):
    """train_sft's line without --apply_chat_template: each row's ids are the tokens of OpenRLHF's text built by hand
    (its default template filled, trailing newlines dropped, " " + eos unless the response ends with it, no special
    tokens), trained from the prompt's own token count on; a conversation is refused in one line (OpenRLHF formats a
    string prompt), and templated with --apply_chat_template."""
    from alignrl.preference.sft import _encode, _keys

    tok = _tokenizer(tiny_model_dir)
    eos = tok.eos_token
    rows = [{"q": "hi", "a": "Paris\n"}, {"q": "1+1", "a": f"2{eos}"}]
    line = ["--pretrain", str(tiny_model_dir), "--dataset", _write(tmp_path / "qa.jsonl", rows), "--input_key", "q",
            "--output_key", "a"]
    cfg = parse_sft(line)
    enc, _, _ = _encode(tok, cfg, _load(cfg.train_files, _keys(cfg, True), 0, "train_files"), [], _Quiet())
    theirs = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    for e, head, text in zip(enc, ("User: hi\nAssistant: ", "User: 1+1\nAssistant: "),
                             ("User: hi\nAssistant: Paris " + eos, f"User: 1+1\nAssistant: 2{eos}")):
        assert e.ids == theirs(text) and e.trained == [i >= len(theirs(head)) for i in range(len(e.ids))]
    line[line.index("--dataset") + 1] = _write(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    cfg = parse_sft(line)
    chat = _load(cfg.train_files, _keys(cfg, True), 0, "train_files")
    with pytest.raises(DataError, match=r"chat.jsonl:1: the row holds chat messages, and input_template"):
        _encode(tok, cfg, chat, [], _Quiet())
    assert _encode(tok, parse_sft([*line, "--apply_chat_template"]), chat, [], _Quiet())[0][0].n_trained

def test_memorising_rows_lowers_the_held_out_loss_and_saves_a_loadable_model(tiny_model_dir, tmp_path):
    from alignrl.models.loader import load_model

    held_out = _write(tmp_path / "eval.jsonl", ROWS[:8])
    res = _run(tiny_model_dir, tmp_path, "sft", f"eval_files=[{held_out}]", "batch_size=4", "epochs=12",
               "learning_rate=3e-3", "warmup_ratio=0")
    before, after = res["before"], res["after"]
    assert res["steps"] == 48 and before["tokens"] == after["tokens"] > 0
    assert after["loss"] < 0.5 * before["loss"] and after["perplexity"] < before["perplexity"]
    rows = [json.loads(line) for line in (tmp_path / "logs_sft" / "metrics.jsonl").read_text().splitlines()]
    keys = set().union(*rows)
    assert {"train/loss", "train/lr", "train/grad_norm", "eval/loss"} <= keys
    model, tok = load_model(str(tmp_path / "sft"))  # what `alignrl train grpo model.path=<folder>` loads
    assert tok.chat_template and model.config.architectures


def test_trls_eos_token_closes_the_completions_and_must_be_a_token(tiny_model_dir):
    from alignrl.config import ConfigError
    from alignrl.preference.sft import _set_eos

    tok = _tokenizer(tiny_model_dir)
    other = next(t for t in tok.all_special_tokens if t != tok.eos_token)  # as '<|im_end|>' for a base model
    _set_eos(tok, other)
    (enc,), _, _ = encode_rows(tok, [SFTRow("x:1", prompt="count from 3", completion="3 4")], SFTKeys(), 64)
    assert enc.ids[-1] == tok.convert_tokens_to_ids(other) and enc.trained[-1]
    with pytest.raises(ConfigError, match=r"^eos_token='<nope>' is not a token of the model's tokenizer"):
        _set_eos(tok, "<nope>")


def test_string_rows_are_text_unless_apply_chat_template_then_the_completion_is_the_assistant_turn(tiny_model_dir):
    tok = _tokenizer(tiny_model_dir)
    row = SFTRow("x:1", prompt="count from 3", completion="3 4")
    (enc,), _, _ = encode_rows(tok, [row], SFTKeys(), 64)  # TRL's way: text, the completion closed by eos
    assert enc.ids == tok("count from 3" + "3 4" + tok.eos_token)["input_ids"]
    trained = [t for t, on in zip(enc.ids, enc.trained) if on]
    assert tok.decode(trained) == "3 4" + tok.eos_token and not any(enc.trained[:len(enc.ids) - len(trained)])
    # OpenRLHF's --apply_chat_template: the completion is the assistant's turn, closed as the template closes one
    (chat,), _, _ = encode_rows(tok, [row], SFTKeys(chat_template=True), 64)
    turns = [{"role": "user", "content": "count from 3"}, {"role": "assistant", "content": "3 4"}]
    assert tok.decode(chat.ids) == tok.apply_chat_template(turns, tokenize=False)
    assert tok.decode([t for t, on in zip(chat.ids, chat.trained) if on]) == "3 4<|im_end|>\n"
    (every,), _, _ = encode_rows(tok, [row], SFTKeys(completion_only=False), 64)
    assert every.n_trained == len(every.ids) - 1  # all but the first token, which nothing predicts
    assert parse_sft(["train_files=[x.jsonl]"]).apply_chat_template is False


def test_eos_is_appended_only_to_a_text_not_ending_with_it(tiny_model_dir):
    tok = _tokenizer(tiny_model_dir)
    rows = [SFTRow("x:1", text="hello world<|im_end|>"), SFTRow("x:2", prompt="say", completion="hi<|im_end|>"),
            SFTRow("x:3", text="hello world")]
    enc, _, _ = encode_rows(tok, rows, SFTKeys(), 64)
    assert [e.ids.count(tok.eos_token_id) for e in enc] == [1, 1, 1] and enc[0].ids == enc[2].ids


def _sentencepiece_like():
    """A Llama-2-style tokenizer (Metaspace, a '▁' before the first word): a text tokenised alone starts with '▁'."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", "▁", *string.ascii_letters, *string.digits, *":+="])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_prompt_and_completion_are_tokenised_together_unless_a_token_spans_the_boundary(tiny_model_dir):
    sp = _sentencepiece_like()
    (enc,), _, _ = encode_rows(sp, [SFTRow("x:1", prompt="2+2=", completion="4")], SFTKeys(), 64)
    assert enc.ids == sp("2+2=4</s>")["input_ids"]  # no spurious '▁' before the completion
    assert sp.convert_ids_to_tokens([t for t, on in zip(enc.ids, enc.trained) if on]) == ["4", "</s>"]
    tok = _tokenizer(tiny_model_dir)
    (same,), _, _ = encode_rows(tok, [SFTRow("x:1", prompt="count from 3", completion="3 4")], SFTKeys(), 64)
    assert same.trained.index(True) == len(tok("count from 3")["input_ids"])
    # "h" + "ello": joined, "he" is one token, so the prompt's tokens are kept and the completion tokenised apart
    (merged,), _, _ = encode_rows(tok, [SFTRow("x:1", prompt="h", completion="ello")], SFTKeys(), 64)
    assert tok("hello")["input_ids"][0] != tok("h")["input_ids"][0]
    assert merged.ids == tok("h")["input_ids"] + tok("ello<|im_end|>")["input_ids"]
    assert tok.decode([t for t, on in zip(merged.ids, merged.trained) if on]) == "ello<|im_end|>"


def test_verl_parquet_columns_and_message_lists_read_through_the_keys(tiny_model_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.table({"question": ["2+2?"], "answer": ["4"]}), path)
    (row,) = load_rows(str(path), SFTKeys(prompt="question", response="answer"))
    assert (row.prompt, row.completion, row.loc) == ("2+2?", "4", f"{path} row 0")
    tok = _tokenizer(tiny_model_dir)
    listed = SFTRow("x:1", prompt=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
                    completion=[{"role": "assistant", "content": "4"}])
    (enc,), _, _ = encode_rows(tok, [listed], SFTKeys(), 64)
    assert tok.decode([t for t, on in zip(enc.ids, enc.trained) if on]) == "4<|im_end|>\n"


def test_assistant_turns_of_a_conversation_are_the_trained_spans(tiny_model_dir):
    tok = _tokenizer(tiny_model_dir)
    (enc,), _, _ = encode_rows(tok, [SFTRow("x:1", messages=CHAT)], SFTKeys(), 128)
    spans, current = [], []
    for t, on in zip(enc.ids, enc.trained):
        if on:
            current.append(t)
        elif current:
            spans, current = spans + [tok.decode(current)], []
    spans += [tok.decode(current)] if current else []
    assert spans == ["yo<|im_end|>\n", "bye<|im_end|>\n"]
    # a template that rewrites earlier turns once later ones follow (as reasoning templates drop old thoughts)
    tok.chat_template = ("{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}<|im_start|>"
                         "assistant\n(old)<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                         "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(DataError, match="x:1: the chat template renders .* assistant_only_loss=false"):
        encode_rows(tok, [SFTRow("x:1", messages=CHAT)], SFTKeys(), 128)


def test_rows_longer_than_max_length_are_cut_and_counted(tiny_model_dir):
    tok = _tokenizer(tiny_model_dir)
    rows = [SFTRow("x:1", prompt="a " * 40, completion="b"), SFTRow("x:2", text="c " * 40), SFTRow("x:3", text="d")]
    enc, cut, dropped = encode_rows(tok, rows, SFTKeys(), 16)
    assert (cut, dropped) == (2, 1) and [len(e.ids) for e in enc] == [16, 2]  # the prompt-only row has nothing left


def test_a_template_that_rewrites_the_prompt_or_no_template_for_messages_is_one_line(tiny_model_dir):
    tok = _tokenizer(tiny_model_dir)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if not loop.last %}(earlier) {% endif %}"
                         "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                         "{% endif %}")
    row = SFTRow("x:1", prompt="count from 3", completion="3 4")
    with pytest.raises(DataError, match="x:1: the chat template renders the prompt differently once the completion"):
        encode_rows(tok, [row], SFTKeys(chat_template=True), 64)
    (every,), _, _ = encode_rows(tok, [row], SFTKeys(chat_template=True, completion_only=False), 64)
    assert tok.decode(every.ids).startswith("<|im_start|>user\n(earlier) count from 3")
    with pytest.raises(DataError, match="x:2: a row of chat messages needs the chat template, and the tokenizer has"):
        encode_rows(_sentencepiece_like(), [SFTRow("x:2", messages=CHAT)], SFTKeys(), 64)


# max_length 40: no row is cut (the longest is 25 tokens), and packed sequences of 40 hold two rows each
ONE_STEP = ["max_steps=1", "learning_rate=1e-3", "warmup_ratio=0", "max_length=40"]


def _step_loss(log_dir: Path) -> float:
    """The first step's logged train/loss: the token mean over all of the step's trained tokens."""
    return json.loads((log_dir / "metrics.jsonl").read_text().splitlines()[0])["train/loss"]


@pytest.fixture(scope="module")
def one_big_batch(tiny_model_dir, tmp_path_factory) -> tuple[dict[str, torch.Tensor], float, dict]:
    """The weights after one optimizer step on one padded micro-batch of 4 rows in one process, its logged loss and
    its results."""
    tmp = tmp_path_factory.mktemp("big")
    res = _run(tiny_model_dir, tmp, "big", "batch_size=4", "gradient_accumulation_steps=1", *ONE_STEP)
    return _weights(tmp / "big"), _step_loss(tmp / "logs_big"), res


def test_gradient_accumulation_gives_the_update_of_one_big_batch(tiny_model_dir, tmp_path, one_big_batch):
    big, big_loss, _ = one_big_batch
    _run(tiny_model_dir, tmp_path, "accum", "batch_size=2", "gradient_accumulation_steps=2", *ONE_STEP)
    accum, base = _weights(tmp_path / "accum"), _weights(tiny_model_dir)
    assert any(not torch.equal(big[k], base[k]) for k in base)
    for k in big:
        torch.testing.assert_close(accum[k], big[k], rtol=0, atol=1e-6)
    assert _step_loss(tmp_path / "logs_accum") == pytest.approx(big_loss, rel=1e-5)  # the loss it optimised


def test_two_ddp_ranks_give_the_update_of_one_big_batch(tiny_model_dir, tmp_path, one_big_batch):
    from conftest import run_group

    data = _write(tmp_path / "train.jsonl", ROWS)
    p = run_group([sys.executable, "-m", "alignrl", "train", "sft", "--nproc", "2", f"model_path={tiny_model_dir}",
                   f"train_files=[{data}]", "--output_dir", str(tmp_path / "ddp"), "--logging_dir",
                   str(tmp_path / "logs"), "report_to=[jsonl]", "batch_size=2", "strategy=ddp", *ONE_STEP], 120,
                  env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert json.loads((tmp_path / "ddp" / "eval_results.json").read_text())["world_size"] == 2
    big, big_loss, _ = one_big_batch
    ddp = _weights(tmp_path / "ddp")
    for k in big:
        torch.testing.assert_close(ddp[k], big[k], rtol=0, atol=1e-6)
    assert _step_loss(tmp_path / "logs") == pytest.approx(big_loss, rel=1e-5)


def test_packed_rows_give_the_padded_step_with_fewer_forward_tokens(tiny_model_dir, tmp_path, one_big_batch):
    big, big_loss, padded = one_big_batch
    res = _run(tiny_model_dir, tmp_path, "packed", "--packing_samples", "batch_size=4",
               "gradient_accumulation_steps=1", *ONE_STEP)
    assert res["packing"] and res["truncated_rows"] == padded["truncated_rows"] == 0
    packed = _weights(tmp_path / "packed")
    for k in big:
        torch.testing.assert_close(packed[k], big[k], rtol=0, atol=1e-5)
    assert _step_loss(tmp_path / "logs_packed") == pytest.approx(big_loss, rel=1e-5)
    # 4 rows of 14..25 tokens: padded, 4 x the longest; packed, 2 sequences of at most 40
    assert 0 < res["forward_tokens"] < padded["forward_tokens"]


def test_neftune_changes_the_training_loss_not_the_held_out_one_and_leaves_no_hook(tiny_model_dir, tmp_path,
                                                                                      monkeypatch):
    import alignrl.preference.sft as sft

    hooked = []

    class Recorded(sft.NEFTune):
        def __init__(self, model, alpha):
            super().__init__(model, alpha)
            hooked.append(model.get_input_embeddings())

    monkeypatch.setattr(sft, "NEFTune", Recorded)
    same = ["batch_size=4", "gradient_accumulation_steps=1", f"eval_files=[{_write(tmp_path / 'ho.jsonl', ROWS[:4])}]",
            *ONE_STEP]
    noisy = _run(tiny_model_dir, tmp_path, "noisy", "neftune_noise_alpha=5", *same)
    quiet = _run(tiny_model_dir, tmp_path, "quiet", *same)
    assert noisy["neftune_noise_alpha"] == 5.0 and len(hooked) == 1
    assert noisy["before"] == quiet["before"] and quiet["before"]["tokens"] > 0  # evaluation draws no noise
    assert _step_loss(tmp_path / "logs_noisy") != pytest.approx(_step_loss(tmp_path / "logs_quiet"), rel=1e-4)
    assert not hooked[0]._forward_hooks  # taken off after training


@pytest.mark.parametrize("extra", [[], ["use_lora=true", "lora_rank=4", "lora_dropout=0.1"],
                                   ["neftune_noise_alpha=5", "packing=true"]], ids=["full", "lora", "neftune"])
def test_a_resumed_run_ends_with_the_weights_of_an_unbroken_one(tiny_model_dir, tmp_path, extra):
    # LoRA's dropout draws and NEFTune's noise too: a resume repeats them
    common = ["batch_size=4", "max_steps=4", "learning_rate=1e-3", *extra]
    _run(tiny_model_dir, tmp_path, "whole", "save_steps=2", *common)
    checkpoint = tmp_path / "whole.checkpoints" / "step_2"
    res = _run(tiny_model_dir, tmp_path, "resumed", f"resume_from={checkpoint}", *common)
    assert res["steps"] == 4
    whole, resumed = _weights(tmp_path / "whole"), _weights(tmp_path / "resumed")
    for k in whole:
        torch.testing.assert_close(resumed[k], whole[k], rtol=0, atol=1e-6)


def test_lora_run_saves_a_merged_plain_folder(tiny_model_dir, tmp_path):
    _run(tiny_model_dir, tmp_path, "lora", "use_lora=true", "lora_rank=4", "batch_size=8", "max_steps=2",
         "learning_rate=1e-2")
    out = tmp_path / "lora"
    assert not (out / "adapter_config.json").exists()
    merged, base = _weights(out), _weights(tiny_model_dir)
    assert merged.keys() == base.keys() and any(not torch.equal(merged[k], base[k]) for k in base)


def test_openrlhf_and_trl_flags_read_as_keys(tmp_path):
    data = _write(tmp_path / "d.jsonl", ROWS)
    cfg = parse_sft(["--pretrain", "demo", "--dataset", f"{data},{data}", "--eval_dataset", data, "--input_key",
                     "question", "--output_key", "answer", "--save_path", str(tmp_path / "o"), "--max_len", "64",
                     "--max_epochs", "2", "--learning_rate", "1e-5", "--micro_train_batch_size", "2",
                     "--apply_chat_template", "--lora_rank", "8", "--gradient_checkpointing", "--save_steps", "-1"])
    assert (cfg.train_files, cfg.eval_files, cfg.prompt_key, cfg.response_key) == ([data, data], [data], "question",
                                                                                   "answer")
    assert (cfg.output_dir, cfg.max_length, cfg.epochs, cfg.batch_size) == (str(tmp_path / "o"), 64, 2, 2)
    assert cfg.apply_chat_template is True and cfg.use_lora and cfg.lora_rank == 8 and cfg.save_steps == 0
    multi = parse_sft(["--dataset", data, "--multiturn", "--input_key", "conversation", "--completion_only_loss",
                       "False"])
    assert multi.messages_key == "conversation" and multi.assistant_only_loss and not multi.completion_only_loss
    pretrain = parse_sft(["--dataset", data, "--input_key", "body", "--pretrain_mode"])  # OpenRLHF trains it as text
    assert (pretrain.text_key, pretrain.prompt_key, pretrain.completion_only_loss) == ("body", "prompt", False)
    assert parse_sft(["--dataset", data, "--multiturn", "true", "--input_key", "conv"]).messages_key == "conv"
    off = parse_sft(["--dataset", data, "--multiturn", "false", "--input_key", "q"])
    assert (off.prompt_key, off.messages_key, off.assistant_only_loss) == ("q", "messages", False)
    assert parse_sft(["--dataset", data, "--max_samples", "5"]).max_train_pairs == 5
    noisy = parse_sft(["--dataset", data, "--neftune_noise_alpha", "5", "--packing_samples"])
    assert noisy.neftune_noise_alpha == 5.0 and noisy.packing
    assert not parse_sft(["--dataset", data]).packing
    assert not parse_sft(["--dataset", data, "--packing", "false"]).packing
    assert parse_sft(["--dataset", data, "--packing", "packing=false"]).packing  # a flag wins over an override
    with pytest.raises(ConfigError, match="--pretrain_mode with --multiturn"):
        parse_sft(["--dataset", data, "--multiturn", "--pretrain_mode", "--input_key", "q"])


def test_trls_packing_packs_the_dataset_and_the_other_spellings_each_micro_batch(tmp_path, capsys):
    data = _write(tmp_path / "d.jsonl", ROWS)
    trl = ["--model_name_or_path", "demo", "--dataset_name", data, "--per_device_train_batch_size", "4"]

    def packing(*line: str) -> tuple[bool, str]:
        cfg = parse_sft(list(line))
        return cfg.packing, cfg.packing_strategy

    assert packing(*trl, "--packing") == (True, "bfd")  # TRL's default packing_strategy, said with its defaults
    assert "packing_strategy=bfd" in capsys.readouterr().err
    assert packing(*trl, "--packing", "--packing_strategy", "wrapped") == (True, "wrapped")
    assert packing(*trl, "--packing", "--padding_free") == (True, "bfd")
    capsys.readouterr()
    assert packing(*trl, "--padding_free") == (True, "micro_batch")  # TRL's padding_free alone: each micro-batch
    assert "packing_strategy" not in capsys.readouterr().err
    assert packing(*trl, "--packing", "false") == (False, "micro_batch")
    assert packing(*trl) == (False, "micro_batch")  # no packing: nothing of it taken
    assert "packing_strategy" not in capsys.readouterr().err
    assert packing(f"train_files=[{data}]", "--packing") == (True, "micro_batch")  # our keys: as before
    assert packing("--pretrain", "demo", "--dataset", data, "--packing_samples") == (True, "micro_batch")
    assert packing(f"train_files=[{data}]", "packing=true", "packing_strategy=bfd") == (True, "bfd")
    # a strategy the line names wins over the one a packing switch brings
    openrlhf = ["--pretrain", "demo", "--dataset", data]
    assert packing(*openrlhf, "--packing_samples", "packing_strategy=bfd") == (True, "bfd")
    assert packing(*trl, "--padding_free", "--packing_strategy", "wrapped") == (True, "wrapped")
    with pytest.raises(ConfigError, match="packing_strategy"):
        parse_sft([f"train_files=[{data}]", "packing=true", "packing_strategy=best"])


def test_openrlhf_conversation_columns_without_and_with_output_key(tiny_model_dir, tmp_path):
    tok = _tokenizer(tiny_model_dir)
    # --input_key conversations --apply_chat_template, no --output_key: the last assistant message is the completion
    (row,) = load_rows(_write(tmp_path / "c.jsonl", [{"conversations": CHAT}]), SFTKeys(prompt="conversations"))
    assert (row.prompt, row.completion) == (CHAT[:-1], CHAT[-1:])
    (enc,), _, _ = encode_rows(tok, [row], SFTKeys(), 128)
    assert tok.decode([t for t, on in zip(enc.ids, enc.trained) if on]) == "bye<|im_end|>\n"
    asked = _write(tmp_path / "q.jsonl", [{"conversations": CHAT[:3]}])
    with pytest.raises(DataError, match="q.jsonl:1: conversations holds messages .* 'user', not 'assistant'"):
        load_rows(asked, SFTKeys(prompt="conversations"))
    # --multiturn --output_key answer: the answer is appended as the last assistant turn
    (turns,) = load_rows(_write(tmp_path / "m.jsonl", [{"conv": CHAT[:3], "answer": "bye"}]),
                         SFTKeys(messages="conv", response="answer"))
    assert turns.messages == CHAT


def test_mistakes_are_one_line(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'prompt_kye' \\(did you mean 'prompt_key'"):
        parse_sft(["train_files=[x.jsonl]", "prompt_kye=q"])
    with pytest.raises(ConfigError, match="--packing_samples=maybe: --packing_samples takes true or false"):
        parse_sft(["--dataset", "x.jsonl", "--packing_samples=maybe"])
    keys = SFTKeys(prompt="question", response="answer")
    bad = _write(tmp_path / "bad.jsonl", [{"question": "q", "answer": "a"}, {"question": "q"}])
    with pytest.raises(DataError, match=f"{bad}:2: row has question but is missing answer"):
        load_rows(bad, keys)
    wrong = _write(tmp_path / "wrong.jsonl", [{"messages": [{"role": "user", "content": "q"}]}])
    with pytest.raises(DataError, match="wrong.jsonl:1: messages has no assistant message"):
        load_rows(wrong, SFTKeys())
    p = subprocess.run([sys.executable, "-m", "alignrl", "train", "sft", f"model_path={tiny_model_dir}",
                        f"train_files=[{bad}]", "prompt_key=question", "response_key=answer"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0, p.stderr
    assert p.stderr.startswith(f"alignrl: error: {bad}:2: row has question but is missing answer")


def test_max_samples_caps_the_rows_of_all_files_together(tmp_path):
    first, second = _write(tmp_path / "a.jsonl", ROWS[:3]), _write(tmp_path / "b.jsonl", ROWS[3:])
    rows = _load([first, second], SFTKeys(), 5, "train_files")
    assert [r.prompt for r in rows] == [r["prompt"] for r in ROWS[:5]]  # 3 of the first file, 2 of the second
    assert len(_load([first, second], SFTKeys(), 0, "train_files")) == 16
    assert len(_load([first, tmp_path / "never_read.jsonl"], SFTKeys(), 2, "train_files")) == 2
