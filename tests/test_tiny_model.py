"""The locally built demo model: HF loadable, tokenizer round trip, deterministic build, SFT learns."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from tokenizers import Tokenizer

from alignrl.models.sft import sft_train
from alignrl.data import synthetic
from alignrl.models.tiny import TinyRecipe, build_demo_model


def test_auto_classes_load_qwen2_with_identical_ids(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert type(tok).__name__ == "Qwen2Tokenizer"  # what transformers builds for a qwen2 folder
    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    for s in synthetic.generate("test", 50, seed=5):
        text = tok.apply_chat_template(s.messages, tokenize=False, add_generation_prompt=True) + s.extra["answer"]
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == raw.encode(text).ids
        assert tok.decode(ids) == text
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    assert model.config.model_type == "qwen2" and model.config.vocab_size == len(tok)


def test_build_is_deterministic(tmp_path):
    recipe = TinyRecipe(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, tokenizer_corpus=200, sft_steps=2,
                        sft_batch_size=4)
    a = build_demo_model(tmp_path / "a", recipe, log=lambda *_: None)
    b = build_demo_model(tmp_path / "b", recipe, log=lambda *_: None)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_sft_lowers_response_loss(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    torch.manual_seed(0)
    losses = sft_train(model, tok, synthetic.generate("train", 64, seed=1), steps=30, batch_size=16, lr=3e-3)
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5


SMALL = dict(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, tokenizer_corpus=200, sft_steps=2, sft_batch_size=4)


def test_shipped_build_is_copied_not_rebuilt(tmp_path, monkeypatch):
    from alignrl.models import tiny

    recipe = TinyRecipe(**SMALL)
    shipped = build_demo_model(tmp_path / "shipped", recipe, log=lambda *_: None)
    monkeypatch.setattr(tiny, "SHIPPED", shipped)
    monkeypatch.setenv("ALIGNRL_CACHE", str(tmp_path / "cache"))

    def no_build(*args, **kwargs):
        raise AssertionError("built although a matching build ships with the package")

    monkeypatch.setattr(tiny, "build_demo_model", no_build)
    path = tiny.ensure_demo_model(recipe, log=lambda *_: None)
    assert path.parent == tmp_path / "cache"
    assert (path / "model.safetensors").read_bytes() == (shipped / "model.safetensors").read_bytes()
    # another recipe is not served the shipped folder: it is built
    with pytest.raises(AssertionError, match="built although"):
        tiny.ensure_demo_model(TinyRecipe(**{**SMALL, "seed": 1}), log=lambda *_: None)


def test_the_shipped_build_is_the_default_recipe():
    """`alignrl build-demo-model --out src/alignrl/models/demo_base` refreshes it when the recipe changes."""
    from alignrl.models.tiny import SHIPPED, demo_model_problem

    assert demo_model_problem(SHIPPED, TinyRecipe()) is None


def test_slipped_sft_solutions_add_what_was_given_away_and_keep_the_answers():
    plain = synthetic.generate("train", 400, seed=2)
    slipped = synthetic.generate("train", 400, seed=2, slip=0.6)
    assert [s.messages for s in slipped] == [s.messages for s in plain]
    assert [s.ground_truth for s in slipped] == [s.ground_truth for s in plain]
    assert [s.extra["answer"] for s in synthetic.generate("train", 400, seed=2, slip=0.0)] == \
        [s.extra["answer"] for s in plain]
    changed = [(a, b) for a, b in zip(plain, slipped) if a.extra["answer"] != b.extra["answer"]]
    gives = [a for a in plain if "gives" in a.messages[-1]["content"]]
    assert 0.45 * len(gives) < len(changed) <= len(gives)  # only "gives away" steps slip, about 60% of them
    for a, b in changed:
        assert "gives" in a.messages[-1]["content"] and b.extra["answer"].count("-") < a.extra["answer"].count("-")
        assert b.extra["answer"].rsplit("#### ", 1)[1] != a.ground_truth  # the mistake is carried to the end
        assert a.extra["answer"].rsplit("#### ", 1)[1] == a.ground_truth
    loses = [(a, b) for a, b in zip(plain, slipped) if "loses" in a.messages[-1]["content"]
             and "gives" not in a.messages[-1]["content"]]
    assert loses and all(a.extra["answer"] == b.extra["answer"] for a, b in loses)  # other subtractions stay
