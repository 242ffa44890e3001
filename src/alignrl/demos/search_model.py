"""The search demo's base model: a tiny Qwen2 with its own tokenizer, SFT'd from a seed on trajectories
of the demo world, most of which guess and some of which search and copy the answer.

Built like the GSM8K demo model (`models/tiny.py`: the same architecture builder, SFT loop, marker file,
atomic rename and build lock) and cached under `$ALIGNRL_CACHE` keyed by a hash of the recipe. The
observations in the SFT trajectories come from the same BM25 retriever and the same passage layout the
retrieval server and the rollout use, so the base model sees at RL time exactly what it was tuned on.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from alignrl.demos.search_data import World, build_world, corpus_rows, sft_samples, tokenizer_texts
from alignrl.models.tiny import TinyRecipe, build_into, cache_root, ensure_built, save_built
from alignrl.rollout.agent import INFO_CLOSE, INFO_OPEN


def _arch() -> TinyRecipe:
    # prompts are Search-R1's ~150-token template; a whole episode stays under 384 tokens
    return TinyRecipe(vocab_size=1536, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


@dataclass(frozen=True)
class SearchRecipe:
    seed: int = 0
    arch: TinyRecipe = field(default_factory=_arch)  # architecture fields only; its SFT fields are unused
    search_fraction: float = 0.35  # SFT trajectories that search; the rest guess
    bare_fraction: float = 0.75  # SFT prompts without Search-R1's instructions (cheaper; see sft_samples)
    topk: int = 1  # passages per search in the SFT observations (the demo's retriever.topk)
    sft_steps: int = 600
    sft_batch_size: int = 16
    sft_lr: float = 8e-3

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


class InProcessSearch:
    """The retrieval server's BM25 and the rollout's passage layout, in this process: `search(queries)`
    gives what a `RetrieverClient` of `alignrl serve retrieve` over the world's corpus would."""

    def __init__(self, world: World, topk: int):
        from alignrl.retrieval.bm25 import BM25Retriever
        from alignrl.retrieval.corpus import Document

        self.retriever = BM25Retriever.build([Document(r["id"], r["contents"]) for r in corpus_rows(world)])
        self.topk = topk

    def search(self, queries: list[str]) -> list[str]:
        from alignrl.rollout.retriever import passages_text

        return [passages_text([{"contents": h.contents} for h in hits])
                for hits in self.retriever.search(queries, self.topk)]

    def observe(self, queries: list[str]) -> list[str]:
        """The observation text a search appends to the episode (`AgentRollout.information_ids`' text)."""
        return [f"{INFO_OPEN}{p.strip()}{INFO_CLOSE}" for p in self.search(queries)]


def _tokenizer(texts: list[str], recipe: SearchRecipe, out_dir: Path):
    from transformers import AutoTokenizer

    from alignrl.models.tokenizer import save_as_qwen2, train_tokenizer

    save_as_qwen2(train_tokenizer(texts, recipe.arch.vocab_size), out_dir, recipe.arch.max_position_embeddings)
    (out_dir / "config.json").write_text(json.dumps({"model_type": "qwen2"}))  # so AutoTokenizer sees qwen2
    return AutoTokenizer.from_pretrained(str(out_dir))


def build_search_model(out_dir: Path, recipe: SearchRecipe = SearchRecipe(), log=print) -> Path:
    """Tokenizer + SFT'd tiny Qwen2 into `out_dir`, built beside it and renamed into place (marker last)."""
    from alignrl.algos.sft import sft_train
    from alignrl.models.tiny import random_tiny_model

    t0 = time.time()
    with build_into(out_dir) as tmp:
        world = build_world(recipe.seed)
        samples = sft_samples(world, InProcessSearch(world, recipe.topk).observe, recipe.search_fraction,
                              recipe.seed + 1, recipe.bare_fraction)
        tokenizer = _tokenizer(tokenizer_texts(world, samples), recipe, tmp)
        model = random_tiny_model(tokenizer, recipe.arch)
        log(f"building search demo base model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-param "
            f"Qwen2, SFT {recipe.sft_steps} steps x {recipe.sft_batch_size} trajectories "
            f"({recipe.search_fraction:.0%} search, the rest guess)")

        def on_step(step: int, loss: float) -> None:
            if (step + 1) % 50 == 0 or step + 1 == recipe.sft_steps:
                log(f"  sft step {step + 1}/{recipe.sft_steps} loss {loss:.3f} ({time.time() - t0:.0f}s)")

        # two phases, bare questions first: sft_train pads each batch to its longest prompt, so a mixed
        # batch would cost as much as a batch of full prompts
        bare = [s for s in samples if s.messages[-1]["content"].startswith("Question:")]
        full = [s for s in samples if not s.messages[-1]["content"].startswith("Question:")]
        split = round(recipe.sft_steps * recipe.bare_fraction)
        for start, part, steps in ((0, bare, split), (split, full, recipe.sft_steps - split)):
            if steps and part:
                sft_train(model, tokenizer, part, steps=steps, batch_size=recipe.sft_batch_size, lr=recipe.sft_lr,
                          seed=recipe.seed, max_prompt_length=recipe.arch.max_position_embeddings,
                          on_step=lambda step, loss, start=start: on_step(start + step, loss))
        save_built(tmp, model, tokenizer, {**asdict(recipe), "key": recipe.key()})
    log(f"search demo base model ready in {time.time() - t0:.0f}s: {out_dir}")
    return out_dir


def ensure_search_model(recipe: SearchRecipe = SearchRecipe(), log=print) -> Path:
    """The cached base model for `recipe`, (re)built first when absent or incomplete."""
    return ensure_built(cache_root() / f"search-demo-{recipe.key()}", recipe,
                        lambda path: build_search_model(path, recipe, log), "search demo model", log)