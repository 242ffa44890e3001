"""The search demo's base model: a tiny Qwen2 with its own tokenizer, SFT'd from a seed on trajectories
of the demo world: first trajectories that all search and copy the answer (so it can copy), then a mix
in which most guess (so, greedy, it guesses; sampled, it searches about a quarter of the time).

Built like the GSM8K demo model (`models/tiny.py`: the same architecture builder, SFT loop, marker file,
atomic rename and build lock) and cached under `$ALIGNRL_CACHE` keyed by a hash of the recipe; the
default recipe's build ships in `search_base/` and is copied into the cache instead of rebuilt. The
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
from alignrl.models.tiny import TinyRecipe, build_into, cache_root, ensure_built, save_built, shipped_or_built
from alignrl.rollout.agent import INFO_CLOSE, INFO_OPEN
from alignrl.utils.progress import Phase

# The default recipe's build (a few MB), so a fresh clone skips minutes of SFT; `alignrl demo search
# --build-base DIR` rebuilds it bit for bit from its seed (the build is deterministic on one torch version).
SHIPPED = Path(__file__).parent / "search_base"
SHIPPED_TOOLS = Path(__file__).parent / "search_tools_base"  # the default recipe's build in the tool loop's format
LOOPS = ("search_r1", "tool")  # the trajectory formats: Search-R1's agent, verl's tool agent loop
# `demo_recipe`'s copy phase for the tool loop: at 700 steps (Search-R1's) its build copied neither the question nor
# the value; at 2000 it copied the value but the question into the query only 63% of the time (greedy)
TOOL_COPY_STEPS = 3000


def _arch() -> TinyRecipe:
    # ~1M parameters: hidden 64 never learnt to copy the answer within the build's budget; an episode (the
    # question, a search, its passage, the restated sentence, the answer) is under 100 tokens
    return TinyRecipe(vocab_size=1536, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


ARCH_FIELDS = ("seed", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "max_position_embeddings")


@dataclass(frozen=True)
class SearchRecipe:
    seed: int = 0
    arch: TinyRecipe = field(default_factory=_arch)  # architecture fields only; its SFT fields are unused
    topk: int = 1  # passages per search in the SFT observations (the demo's retriever.topk)
    copy_steps: int = 700  # phase 1: every trajectory searches, so the model learns to copy
    sft_steps: int = 300  # phase 2: the mix that sets how often the base model searches
    search_fraction: float = 0.35  # phase 2 trajectories that search; the rest guess
    sft_batch_size: int = 16
    sft_lr: float = 3e-3
    loop: str = "search_r1"  # the trajectories' format (LOOPS): Search-R1's tags, or verl's tool loop's chat

    def __post_init__(self):
        if self.loop not in LOOPS:
            from alignrl.config import ConfigError

            raise ConfigError(f"SearchRecipe.loop={self.loop!r}: use one of {', '.join(LOOPS)}")

    def record(self) -> dict:
        """The recipe as built: the architecture fields of `arch` only, so a field the GSM8K demo adds to
        TinyRecipe for its own SFT neither changes this model's key nor invalidates its shipped build; `loop`
        only when it is not Search-R1's, so the recipes from before it keep their keys and shipped build."""
        d = asdict(self)
        d["arch"] = {k: d["arch"][k] for k in ARCH_FIELDS}
        if self.loop == "search_r1":
            del d["loop"]
        return d

    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.record(), sort_keys=True).encode()).hexdigest()[:12]


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

    def contents(self, queries: list[str]) -> list[list[str]]:
        """Each query's passages as the server answers them (`RetrieverClient.search_contents`)."""
        return [[h.contents for h in hits] for hits in self.retriever.search(queries, self.topk)]

    def observe(self, queries: list[str]) -> list[str]:
        """The observation text a search appends to the episode (`AgentRollout.information_ids`' text)."""
        return [f"{INFO_OPEN}{p.strip()}{INFO_CLOSE}" for p in self.search(queries)]


def _tokenizer(texts: list[str], recipe: SearchRecipe, out_dir: Path):
    from transformers import AutoTokenizer

    from alignrl.models.tokenizer import save_as_qwen2, train_tokenizer

    save_as_qwen2(train_tokenizer(texts, recipe.arch.vocab_size), out_dir, recipe.arch.max_position_embeddings)
    (out_dir / "config.json").write_text(json.dumps({"model_type": "qwen2"}))  # so AutoTokenizer sees qwen2
    return AutoTokenizer.from_pretrained(str(out_dir))


def trajectory_ids(tokenizer, text: str) -> tuple[list[int], list[bool]]:
    """A trajectory's ids as a rollout produces them (generated pieces and observations encoded apart, then
    eos) and its loss mask: True on the generated pieces only."""
    ids: list[int] = []
    mask: list[bool] = []
    rest = text
    while INFO_OPEN in rest:
        head, tail = rest.split(INFO_OPEN, 1)
        obs, rest = tail.split(INFO_CLOSE, 1)
        for piece, trained in ((head, True), (INFO_OPEN + obs + INFO_CLOSE, False)):
            piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
            ids += piece_ids
            mask += [trained] * len(piece_ids)
    tail_ids = tokenizer(rest + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    return ids + tail_ids, mask + [True] * len(tail_ids)


def sft_masked(model, tokenizer, prompts: list, pairs: list, *, steps: int, batch_size: int, lr: float, seed: int,
               on_step=None) -> None:
    """SFT as `algos.sft.sft_train` does it (cosine-scheduled AdamW over seeded shuffled batches), with the
    loss on generated tokens only, as PPO with state masking has it. Why it matters here: the passage's
    value follows " is" and cannot be known, so training on it teaches "after ' is', any value", the very
    words after which the restated sentence must copy the value. `prompts`: each trajectory's prompt ids;
    `pairs`: its response ids and loss mask."""
    import torch

    from alignrl.data.collate import left_pad, right_pad
    from alignrl.models.logprobs import response_logprobs
    from alignrl.core.optim import build_optimizer

    opt, sched = build_optimizer(model.parameters(), lr, 0.0, (0.9, 0.95), 10, steps, "cosine", 0.1)
    gen = torch.Generator().manual_seed(seed)
    order, pos, pad = torch.randperm(len(prompts), generator=gen), 0, tokenizer.pad_token_id
    model.train()
    for step in range(steps):
        if pos + batch_size > len(prompts):  # a new epoch, a new order
            order, pos = torch.randperm(len(prompts), generator=gen), 0
        idx = order[pos:pos + batch_size].tolist()
        pos += batch_size
        pi, pm = left_pad([prompts[i] for i in idx], pad)
        ri, rm = right_pad([pairs[i][0] for i in idx], pad)
        lm = right_pad([[int(t) for t in pairs[i][1]] for i in idx], 0)[0].float()
        logp, _ = response_logprobs(model, pi, pm, ri, rm)
        loss = -(logp * lm).sum() / lm.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if on_step is not None:
            on_step(step, loss.item())
    model.eval()


def _search_r1_phases(world: World, recipe: SearchRecipe, folder: Path) -> tuple:
    """The tokenizer (trained into `folder`) and the SFT phases, (prompt ids, (response ids, loss mask), steps)
    each, in Search-R1's format."""
    from alignrl.data.collate import encode_prompts

    questions = [f.question for f in world.facts["sft"]]  # phase 1 searches them all: search each once
    found = dict(zip(questions, InProcessSearch(world, recipe.topk).observe(questions)))

    def observe(queries: list[str]) -> list[str]:
        return [found[q] for q in queries]

    sets = [sft_samples(world, observe, 1.0, recipe.seed + 1),
            sft_samples(world, observe, recipe.search_fraction, recipe.seed + 2)]
    tokenizer = _tokenizer(tokenizer_texts(world, sets[1]), recipe, folder)
    return tokenizer, [(encode_prompts(tokenizer, samples, 10**6),
                        [trajectory_ids(tokenizer, s.extra["answer"]) for s in samples], steps)
                       for samples, steps in zip(sets, (recipe.copy_steps, recipe.sft_steps))]


def _tool_phases(world: World, recipe: SearchRecipe, folder: Path) -> tuple:
    """`_search_r1_phases` in verl's tool loop's format: the prompts templated with the demo tool config's schemas,
    the tool turns rendered by the loop itself (`search_tools.tool_turns`), the chat template printing the tools."""
    import tempfile

    from alignrl.data.collate import encode_prompts
    from alignrl.demos import search_tools as st

    with tempfile.TemporaryDirectory() as scratch:
        schemas = st.demo_schemas(Path(scratch))
        # the tool turns' text is the template's, whatever the vocabulary: a throwaway tokenizer renders them
        render = _tokenizer(["x"], recipe, Path(scratch))
    render.chat_template = st.TOOL_CHAT_TEMPLATE
    feedback = st.tool_turns(world.facts["sft"], InProcessSearch(world, recipe.topk).contents, render, schemas)
    sets = [st.tool_sft_samples(world, feedback, fraction, recipe.seed + k, render.eos_token)
            for k, fraction in ((1, 1.0), (2, recipe.search_fraction))]
    tokenizer = _tokenizer(st.tool_tokenizer_texts(world, sets[1], schemas), recipe, folder)
    tokenizer.chat_template = st.TOOL_CHAT_TEMPLATE  # saved with the model (chat_template.jinja)
    return tokenizer, [(encode_prompts(tokenizer, samples, 10**6, tools=schemas),
                        [st.tool_trajectory_ids(tokenizer, s.extra["turns"]) for s in samples], steps)
                       for samples, steps in zip(sets, (recipe.copy_steps, recipe.sft_steps))]


def build_search_model(out_dir: Path, recipe: SearchRecipe = SearchRecipe(), log=print) -> Path:
    """Tokenizer + SFT'd tiny Qwen2 into `out_dir`, built beside it and renamed into place (marker last)."""
    from alignrl.models.tiny import random_tiny_model

    t0 = time.time()
    with build_into(out_dir) as tmp:
        world = build_world(recipe.seed)
        tokenizer, phases = (_tool_phases if recipe.loop == "tool" else _search_r1_phases)(world, recipe, tmp)
        model = random_tiny_model(tokenizer, recipe.arch)
        total = recipe.copy_steps + recipe.sft_steps
        log(f"building search demo base model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-param "
            f"Qwen2, SFT {recipe.copy_steps} steps on trajectories that all search, then {recipe.sft_steps} "
            f"on a mix ({recipe.search_fraction:.0%} search, the rest guess), {recipe.sft_batch_size} a step")

        def on_step(step: int, loss: float) -> None:
            progress.advance()  # the build's bar, opened below
            if (step + 1) % 100 == 0 or step + 1 == total:
                log(f"  sft step {step + 1}/{total} loss {loss:.3f} ({time.time() - t0:.0f}s)")

        # Copying the answer out of a passage is learnt suddenly, after a plateau, and only from trajectories
        # that search: an all-search phase gets there within the build's budget; the mix after it only
        # moves the first choice (search or guess), which is learnt fast, and keeps copying trained.
        start = 0
        with Phase("search demo base model SFT", total, "steps", say=False) as progress:  # the log has its lines
            for prompts, pairs, steps in phases:
                if steps:
                    sft_masked(model, tokenizer, prompts, pairs, steps=steps, batch_size=recipe.sft_batch_size,
                               lr=recipe.sft_lr, seed=recipe.seed,
                               on_step=lambda step, loss, start=start: on_step(start + step, loss))
                start += steps
        save_built(tmp, model, tokenizer, {**recipe.record(), "key": recipe.key()})
    log(f"search demo base model ready in {time.time() - t0:.0f}s: {out_dir}")
    return out_dir


def demo_recipe(seed: int = 0, loop: str = "search_r1") -> SearchRecipe:
    """The demo's recipe for `loop`. The tool loop's episodes are longer (the schema in the prompt, the hermes call's
    JSON, the tool turn's): copying the question into the query and the value into the answer took longer to learn
    there; its copy phase is longer."""
    return SearchRecipe(seed=seed, loop=loop, copy_steps=TOOL_COPY_STEPS) if loop == "tool" else SearchRecipe(seed)


def ensure_search_model(recipe: SearchRecipe = SearchRecipe(), log=print) -> Path:
    """The cached base model for `recipe`, (re)built first when absent or incomplete. The default recipe's
    build ships with the package (`SHIPPED`): it is copied into the cache instead."""
    tools = recipe.loop == "tool"
    hint = f"alignrl demo search --seed {recipe.seed}{' --tool-loop' if tools else ''} --build-base DIR"
    build = shipped_or_built(SHIPPED_TOOLS if tools else SHIPPED, recipe,
                             lambda path: build_search_model(path, recipe, log), hint, "search demo base model", log)
    return ensure_built(cache_root() / f"search-demo-{recipe.key()}", recipe, build, "search demo model", log)
