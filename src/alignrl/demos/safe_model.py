"""The safety demo's base model: a tiny Qwen2 with its own tokenizer, SFT'd from a seed on the demo world's
SFT data (`safe_data.sft_samples`): everyday requests answered, red-team requests refused in two harm
categories and complied with in the other three.

Built like the GSM8K demo model (`models/tiny.py`: the same architecture builder, SFT loop, marker file,
atomic rename and build lock) and cached under `$ALIGNRL_CACHE` keyed by a hash of the recipe; the default
recipe's build ships in `demos/data/safe_base/` and is copied into the cache instead of rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from alignrl.demos.safe_data import DATA_DIR, sft_samples, tokenizer_texts
from alignrl.models.tiny import (TinyRecipe, build_into, cache_root, ensure_built, save_built, sft_with_progress,
                                 shipped_or_built)

# The default recipe's build (about 2 MB), so a fresh clone skips the SFT; `alignrl demo safe --build-base DIR`
# rebuilds it bit for bit from its seed (the build is deterministic on one torch version).
SHIPPED = DATA_DIR / "safe_base"


@dataclass(frozen=True)
class SafeRecipe:
    seed: int = 0
    vocab_size: int = 768  # the world's ~400 words are whole tokens: replies of 15-25 tokens
    hidden_size: int = 96
    intermediate_size: int = 256
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 128
    sft_steps: int = 300
    sft_batch_size: int = 32
    sft_lr: float = 3e-3

    def arch(self) -> TinyRecipe:
        return TinyRecipe(seed=self.seed, vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                          intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
                          num_attention_heads=self.num_attention_heads,
                          num_key_value_heads=self.num_key_value_heads,
                          max_position_embeddings=self.max_position_embeddings)

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def _tokenizer(recipe: SafeRecipe, out_dir: Path):
    from transformers import AutoTokenizer

    from alignrl.models.tokenizer import save_as_qwen2, train_tokenizer

    save_as_qwen2(train_tokenizer(tokenizer_texts(recipe.seed), recipe.vocab_size), out_dir,
                  recipe.max_position_embeddings)
    (out_dir / "config.json").write_text(json.dumps({"model_type": "qwen2"}))  # so AutoTokenizer sees qwen2
    return AutoTokenizer.from_pretrained(str(out_dir))


def build_safe_model(out_dir: Path, recipe: SafeRecipe = SafeRecipe(), log=print) -> Path:
    """Tokenizer + SFT'd tiny Qwen2 into `out_dir`, built beside it and renamed into place (marker last)."""
    import torch

    from alignrl.models.tiny import random_tiny_model

    t0 = time.time()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same float sums, so the same bytes, on any machine's core count
    try:
        with build_into(out_dir) as tmp:
            tokenizer = _tokenizer(recipe, tmp)
            model = random_tiny_model(tokenizer, recipe.arch())
            data = sft_samples(recipe.seed)
            log(f"building safety demo base model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-param "
                f"Qwen2, SFT {recipe.sft_steps} steps x {recipe.sft_batch_size} of {len(data)} replies")

            sft_with_progress("safety demo base model SFT", model, tokenizer, data, recipe, log, t0, every=100)
            save_built(tmp, model, tokenizer, {**asdict(recipe), "key": recipe.key()})
    finally:
        torch.set_num_threads(threads)
    log(f"safety demo base model ready in {time.time() - t0:.0f}s: {out_dir}")
    return out_dir


def ensure_safe_model(recipe: SafeRecipe = SafeRecipe(), log=print) -> Path:
    """The cached base model for `recipe`, (re)built first when absent or incomplete; the default recipe's
    shipped build is copied into the cache instead."""
    build = shipped_or_built(SHIPPED, recipe, lambda path: build_safe_model(path, recipe, log),
                             f"alignrl demo safe --seed {recipe.seed} --build-base DIR", "safety demo base model", log)
    return ensure_built(cache_root() / f"safe-demo-{recipe.key()}", recipe, build, "safety demo model", log)
