"""Train a small byte-level BPE tokenizer that loads back identically as a Qwen2 tokenizer.

transformers 5 rebuilds a `qwen2` folder's tokenizer as `Qwen2Tokenizer`, which installs its own
normalizer and pre-tokenizer (NFC, the Qwen2 split regex, byte-level without regex). A tokenizer
trained with any other pipeline would silently produce different ids after loading, so we train
with exactly that pipeline; `tests/test_tiny_model.py` checks the round trip.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# Same regex as transformers' Qwen2Tokenizer: digits are split one by one, which helps arithmetic.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END]

# ChatML, as Qwen2-Instruct models use; the generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_as_qwen2(tok: Tokenizer, out_dir: Path, model_max_length: int):
    """Write tokenizer.json + tokenizer_config.json so AutoTokenizer yields the same ids."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, unk_token=None,
                                 model_max_length=model_max_length)
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(out_dir))
    # Declare the class a Qwen2 checkpoint uses, so the folder behaves like one everywhere.
    import json

    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg_path.write_text(json.dumps(cfg, indent=2))
