"""Preference data: shipped files, both row layouts, one-line errors, tokenisation and collation."""

import json

import pytest
import torch

from alignrl.data.loaders import DataError
from alignrl.data.preference import (collate_pairs, encode_pairs, load_pairs, require_safety_labels,
                                     resolve_data_path)
from alignrl.data.preference_synthetic import SHIPPED, write_shipped


def _write(tmp_path, rows, name="pairs.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_shipped_files_are_regenerated_exactly(tmp_path):
    for p in write_shipped(tmp_path):
        assert p.read_bytes() == (SHIPPED / p.name).read_bytes(), f"{p.name} drifted from its generator"


def test_shipped_splits_sizes_labels_and_disjoint_prompts():
    for task in ("helpful", "harmless"):
        train, test = load_pairs(f"builtin:{task}"), load_pairs(f"builtin:{task}_test")
        assert (len(train), len(test)) == (400, 100)
        assert not {p.prompt[0]["content"] for p in train} & {p.prompt[0]["content"] for p in test}
        assert all(p.chosen != p.rejected for p in train + test)
    harmless = load_pairs("builtin:harmless")
    require_safety_labels(harmless, "harmless")
    assert any(p.chosen_safe is False for p in harmless)  # pairs where both responses are unsafe
    assert all(p.rejected_safe is False for p in harmless)
    assert all(p.chosen.rstrip().split("\n")[-1].startswith("#### ") for p in load_pairs("builtin:helpful"))


def test_trl_string_and_conversational_forms(tmp_path):
    rows = [{"prompt": "2+2?", "chosen": "4", "rejected": "5", "is_chosen_safe": True, "is_rejected_safe": False,
             "margin": 1.5},
            {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
             "chosen": [{"role": "assistant", "content": "hello"}], "rejected": [{"role": "assistant", "content": "go"}]},
            {"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "good"}],
             "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "bad"}]}]
    a, b, c = load_pairs(_write(tmp_path, rows))
    assert a.prompt == [{"role": "user", "content": "2+2?"}] and (a.chosen, a.rejected) == ("4", "5")
    assert (a.chosen_safe, a.rejected_safe, a.margin) == (True, False, 1.5)
    assert b.prompt[0]["role"] == "system" and (b.chosen, b.rejected) == ("hello", "go") and b.chosen_safe is None
    assert c.prompt == [{"role": "user", "content": "q"}] and (c.chosen, c.rejected) == ("good", "bad")


def test_pku_saferlhf_layout_better_or_safer(tmp_path):
    row = {"prompt": "p", "response_0": "r0", "response_1": "r1", "is_response_0_safe": False,
           "is_response_1_safe": True, "better_response_id": 0, "safer_response_id": 1}
    path = _write(tmp_path, [row])
    better, = load_pairs(path, "better")
    safer, = load_pairs(path, "safer")
    assert (better.chosen, better.rejected, better.chosen_safe, better.rejected_safe) == ("r0", "r1", False, True)
    assert (safer.chosen, safer.rejected, safer.chosen_safe, safer.rejected_safe) == ("r1", "r0", True, False)
    floats, = load_pairs(_write(tmp_path, [{**row, "better_response_id": 1.0}]), "better")  # pandas with nulls
    assert floats.chosen == "r1"


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "q"}],
                                          "chosen": [{"role": "assistant", "content": "y"}],
                                          "rejected": [{"role": "assistant", "content": "n"}]}]), path)
    pair, = load_pairs(str(path))
    assert (pair.prompt[0]["content"], pair.chosen, pair.rejected) == ("q", "y", "n")


@pytest.mark.parametrize("rows, expect", [
    (['{"prompt": "a", "chosen": "b", "rejected": "c"}', '{not json'], "pairs.jsonl:2: line is not valid JSON"),
    ([{"prompt": "a", "chosen": "b"}], "pairs.jsonl:1: row is missing rejected"),
    ([{"prompt": "a", "chosen": "b", "rejected": "c", "is_chosen_safe": "yes"}],
     "pairs.jsonl:1: is_chosen_safe must be true or false"),
    ([{"prompt": "a", "response_0": "x", "response_1": "y"}], "pairs.jsonl:1: row is missing better_response_id"),
    ([{"prompt": "a", "response_0": "x", "response_1": "y", "better_response_id": 0.5}],
     "pairs.jsonl:1: better_response_id must be 0 or 1, got 0.5"),
    ([{"prompt": [{"role": "user"}], "chosen": "b", "rejected": "c"}], "lacks role/content"),
    ([{"chosen": "b", "rejected": "c"}], "pairs.jsonl:1: row is missing prompt"),
])
def test_bad_rows_raise_one_line_errors(tmp_path, rows, expect):
    with pytest.raises(DataError) as e:
        load_pairs(_write(tmp_path, rows))
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_missing_file_unknown_builtin_and_missing_labels(tmp_path):
    with pytest.raises(DataError, match="data file not found: .*nope.jsonl"):
        load_pairs(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="builtin:helpful"):
        resolve_data_path("builtin:nope")
    pairs = load_pairs(_write(tmp_path, [{"prompt": "a", "chosen": "b", "rejected": "c"}]))
    with pytest.raises(DataError, match=r"pairs.jsonl:1: row is missing is_chosen_safe/is_rejected_safe"):
        require_safety_labels(pairs, "x")


def test_encode_and_collate(tiny_model):
    _, tok = tiny_model
    pairs = load_pairs("builtin:harmless_test")[:3]
    enc, cut = encode_pairs(tok, pairs, 512)
    assert cut == 0
    e = enc[0]
    prompt_text = tok.decode(e.prompt)
    assert prompt_text.endswith("<|im_start|>assistant\n") and pairs[0].prompt[0]["content"] in prompt_text
    assert e.chosen[-1] == tok.eos_token_id and tok.decode(e.chosen[:-1]) == pairs[0].chosen
    b = collate_pairs(enc, pairs, tok.pad_token_id)
    assert b.n_pairs == 3 and b.prompt_ids.shape[0] == b.response_ids.shape[0] == 6
    assert b.prompt_mask[:, -1].all()  # left-padded prompts end at the last column
    assert b.response_mask[:, 0].all()  # right-padded responses start at column 0
    assert b.response_ids[0, :len(e.chosen)].tolist() == e.chosen
    assert b.response_ids[3, :len(e.rejected)].tolist() == e.rejected  # rejected rows follow the chosen ones
    assert b.index.tolist() == [0, 1, 2] and b.weight.tolist() == [1.0, 1.0, 1.0]
    assert b.rejected_unsafe.tolist() == [float(not p.rejected_safe) for p in pairs]
    # truncation: prompt keeps at most half of max_length (its end), responses the rest
    enc2, cut2 = encode_pairs(tok, pairs, 24)
    assert cut2 == 3
    for a, full in zip(enc2, enc):
        assert len(a.prompt) <= 12 and a.prompt == full.prompt[-len(a.prompt):]
        assert len(a.prompt) + max(len(a.chosen), len(a.rejected)) <= 24
    assert torch.equal(collate_pairs(enc2, pairs, tok.pad_token_id).index, torch.arange(3))
    from alignrl.data.preference import truncation_note
    assert truncation_note(enc, cut, 512) == "0 pairs truncated to max_length=512"
    # one pair's responses differ only after their 12 tokens' room: the cut leaves them the same
    assert truncation_note(enc2, cut2, 24) == ("3 pairs truncated to max_length=24, 1 of them now with identical "
                                               "responses (raise max_length)")
    assert sum(e.chosen == e.rejected for e in enc2) == 1



def test_pairs_without_the_chat_template_are_openrlhfs_or_trls_text(tiny_model, tmp_path):
    """apply_chat_template=false: with input_template each response's prompt + response ids are the tokens of
    OpenRLHF's text built by hand (the template filled, the implicit prompt left as it is, " " + eos, no special
    tokens), the prompt its own tokens unless a token merges across its end differently in the two responses;
    without one, TRL's (the prompt and the response + eos each tokenised alone). A prompt of chat messages is
    refused with a template and templated without one."""
    _, tok = tiny_model
    theirs = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos, template = tok.eos_token, "User: {}\nAssistant: "
    rows = [{"prompt": "Capital of France?", "chosen": "Paris\n\n", "rejected": "Rome"},
            {"chosen": "Q: 2+2? A: 4", "rejected": "Q: 2+2? A: 5"},
            {"prompt": "p", "response_0": "a", "response_1": "b", "better_response_id": 1, "safer_response_id": 0}]
    pairs = load_pairs(_write(tmp_path, rows))
    enc, _ = encode_pairs(tok, pairs, 512, chat_template=False, input_template=template)
    head = "User: Capital of France?\nAssistant: "
    assert enc[0].prompt == theirs(head)  # OpenRLHF's prompt_ids_len
    assert (enc[0].prompt + enc[0].chosen, enc[0].prompt + enc[0].rejected) == (
        theirs(head + "Paris " + eos), theirs(head + "Rome " + eos))
    assert enc[1].prompt + enc[1].chosen == theirs("Q: 2+2? A: 4 " + eos)  # the implicit prompt is not formatted
    assert enc[2].prompt + enc[2].chosen == theirs("User: p\nAssistant: b " + eos)
    raw, _ = encode_pairs(tok, pairs, 512, False, "{}")
    assert raw[0].prompt + raw[0].rejected == theirs("Capital of France?Rome " + eos)
    trl, _ = encode_pairs(tok, pairs, 512, False, None)
    assert (trl[0].prompt, trl[0].chosen) == (theirs("Capital of France?"), theirs("Paris\n\n" + eos))
    # "Use" + "r" merges to "Us|er" and "Use" + "d" stays "Us|e|d": the prompt keeps only the shared "Us"
    merged = load_pairs(_write(tmp_path, [{"prompt": "Use", "chosen": "r", "rejected": "d"}], "merged.jsonl"))
    (e,), _ = encode_pairs(tok, merged, 512, False, "{}")
    assert (e.prompt + e.chosen, e.prompt + e.rejected) == (theirs("User " + eos), theirs("Used " + eos))
    assert e.prompt == theirs("Use")[:len(e.prompt)] and len(e.prompt) < len(theirs("Use"))
    chat = [{"prompt": [{"role": "user", "content": "Hi?"}], "chosen": "Yes.", "rejected": "No."}]
    conv = load_pairs(_write(tmp_path, chat, "chat.jsonl"))
    with pytest.raises(DataError, match=r"chat.jsonl:1: the row holds chat messages, and input_template"):
        encode_pairs(tok, conv, 512, False, template)
    assert encode_pairs(tok, conv, 512, False, None) == encode_pairs(tok, conv, 512)  # messages: templated
    assert encode_pairs(tok, pairs, 512, True, template) == encode_pairs(tok, pairs, 512)  # ignored with the chat

def test_trl_implicit_prompt_in_whole_texts_and_whole_conversations(tmp_path):
    """TRL's implicit prompt: no `prompt` key; the shared beginning of chosen and rejected is the prompt, and a space
    before the first difference stays with the responses (as TRL's maybe_extract_prompt splits them)."""
    user, a = {"role": "user", "content": "Sky colour?"}, "assistant"
    rows = [{"chosen": "The sky is blue.", "rejected": "The sky is green."},
            {"chosen": [{"role": "system", "content": "Be brief."}, user, {"role": a, "content": "Blue."}],
             "rejected": [{"role": "system", "content": "Be brief."}, user, {"role": a, "content": "Green."}]}]
    text, chat = load_pairs(_write(tmp_path, rows))
    assert (text.prompt, text.chosen, text.rejected) == ([{"role": "user", "content": "The sky is"}], " blue.",
                                                         " green.")
    assert (chat.prompt, chat.chosen, chat.rejected) == (rows[1]["chosen"][:2], "Blue.", "Green.")


def test_trl_prompt_with_whole_conversations_keeps_what_follows_it(tmp_path):
    """`prompt` given and chosen/rejected repeating it (whole conversations, or texts that both start with it): the
    responses are what follows the prompt. A text only one response starts with stays whole."""
    user = [{"role": "user", "content": "2+2?"}]
    rows = [{"prompt": user, "chosen": user + [{"role": "assistant", "content": "4"}],
             "rejected": user + [{"role": "assistant", "content": "5"}]},
            {"prompt": "2+2? ", "chosen": "2+2? 4", "rejected": "2+2? 5"},
            {"prompt": "Say 2+2", "chosen": "Say 2+2 is 4", "rejected": "It is 5"}]
    chat, text, one = load_pairs(_write(tmp_path, rows))
    assert (chat.prompt, chat.chosen, chat.rejected) == (user, "4", "5")
    assert (text.prompt, text.chosen, text.rejected) == ([{"role": "user", "content": "2+2? "}], "4", "5")
    assert (one.chosen, one.rejected) == ("Say 2+2 is 4", "It is 5")


LAYOUTS = {
    "implicit": lambda i: {"chosen": f"Q{i}: what is {i}+{i}? A: {2 * i}", "rejected": f"Q{i}: what is {i}+{i}? A: x"},
    "prompt_and_conversations": lambda i: {
        "prompt": [{"role": "user", "content": f"what is {i}+{i}?"}],
        "chosen": [{"role": "user", "content": f"what is {i}+{i}?"}, {"role": "assistant", "content": f"{2 * i}"}],
        "rejected": [{"role": "user", "content": f"what is {i}+{i}?"}, {"role": "assistant", "content": "x"}]},
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_dpo_and_rm_train_on_trls_other_layouts(layout, tiny_model_dir, tmp_path):
    """`alignrl train dpo` and `train rm` train on each of these layouts as on the explicit one."""
    import json as _json

    from alignrl.preference.cli import dpo_main, rm_main

    train = _write(tmp_path, [LAYOUTS[layout](i) for i in range(8)], "train.jsonl")
    held = _write(tmp_path, [LAYOUTS[layout](i) for i in range(8, 12)], "held.jsonl")
    small = ["batch_size=4", "eval_batch_size=4", "epochs=1", "log_every=1", "report_to=[jsonl]",
             f"model_path={tiny_model_dir}"]
    assert rm_main(["--task", "helpful", "--output_dir", str(tmp_path / "rm"), "--logging_dir", str(tmp_path / "l1"),
                    f"helpful_train_file={train}", f"helpful_eval_file={held}", *small]) == 0
    assert dpo_main(["--output_dir", str(tmp_path / "dpo"), "--logging_dir", str(tmp_path / "l2"),
                     f"train_files=[{train}]", f"eval_files=[{held}]", "gradient_checkpointing=false", "loss_type=sigmoid",
                     *small]) == 0
    for name in ("rm", "dpo"):
        assert _json.loads((tmp_path / name / "eval_results.json").read_text())  # trained, evaluated, saved

