"""The embedded demo base model, built here from a seed: no hub download.

Recipe: train a byte-level BPE tokenizer on the synthetic arithmetic task, initialise a small
Qwen2-architecture causal LM, and supervised-fine-tune it on worked solutions that carry two flaws of
real SFT data, so that RL has something to fix beyond luck:
- like a chat model fine-tuned on mixed sources, only part of its answers end with the strict `#### N`
  line (the rest with "The answer is N."; `plain_answer_fraction` of the SFT targets);
- like a model fine-tuned on a sloppy annotator's solutions, it has a misconception: `slip_fraction` of the
  "gives N to a friend" steps in its SFT targets add N instead of subtracting it (the same subtraction
  phrased "loses N" is always right, so the model can subtract). Its greedy answer to a "gives" problem is
  then usually wrong while its samples are sometimes right: the room (pass@k above pass@1) that RL from the
  answer reward alone turns into greedy accuracy.
The result is a plain HF folder loadable with `AutoModelForCausalLM`.

The folder is cached under `$ALIGNRL_CACHE` (default `~/.cache/alignrl`) keyed by a hash of the
recipe, so a second run reuses it and a changed recipe never picks up a stale model. A cached folder is
checked before use and rebuilt when incomplete; concurrent builders serialise on a file lock.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from alignrl.data import synthetic
from alignrl.utils.atomic import replace_dir
from alignrl.utils.progress import Phase

MARKER = "recipe.json"  # written last: a folder without it was never finished
# The default recipe's build (a few MB), so a fresh clone skips minutes of SFT; `alignrl build-demo-model`
# rebuilds it bit for bit from its seed (the build is deterministic on one torch version).
SHIPPED = Path(__file__).parent / "demo_base"


@dataclass(frozen=True)
class TinyRecipe:
    seed: int = 0
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    tokenizer_corpus: int = 5000  # synthetic problems the tokenizer is trained on
    sft_steps: int = 600
    sft_batch_size: int = 64
    sft_lr: float = 3e-3
    plain_answer_fraction: float = 0.5  # SFT targets ending "The answer is N." instead of "#### N"
    slip_fraction: float = 0.7  # "gives away" steps the SFT targets add instead of subtract

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def cache_root() -> Path:
    return Path(os.environ.get("ALIGNRL_CACHE", Path.home() / ".cache" / "alignrl"))


def random_tiny_model(tokenizer, recipe: TinyRecipe):
    """An untrained Qwen2 LM sized by `recipe`, seeded by `recipe.seed`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=recipe.hidden_size,
                      intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.num_hidden_layers,
                      num_attention_heads=recipe.num_attention_heads,
                      num_key_value_heads=recipe.num_key_value_heads,
                      max_position_embeddings=recipe.max_position_embeddings, tie_word_embeddings=True,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                      bos_token_id=None)
    torch.manual_seed(recipe.seed)
    return Qwen2ForCausalLM(cfg)


def build_tokenizer(recipe: TinyRecipe, out_dir: Path):
    from transformers import AutoTokenizer

    from alignrl.models.tokenizer import save_as_qwen2, train_tokenizer

    corpus = synthetic.generate("train", recipe.tokenizer_corpus, seed=recipe.seed + 1)
    texts = [s.messages[-1]["content"] + "\n" + s.extra["answer"] for s in corpus]
    out_dir.mkdir(parents=True, exist_ok=True)
    save_as_qwen2(train_tokenizer(texts, recipe.vocab_size), out_dir, recipe.max_position_embeddings)
    (out_dir / "config.json").write_text(json.dumps({"model_type": "qwen2"}))  # so AutoTokenizer sees qwen2
    return AutoTokenizer.from_pretrained(str(out_dir))


def sft_data(recipe: TinyRecipe):
    """Worked solutions for SFT; a seeded `plain_answer_fraction` of them end in a plain-text answer."""
    import random

    rng = random.Random(recipe.seed + 3)
    out = []
    for s in synthetic.generate("train", recipe.sft_steps * recipe.sft_batch_size, seed=recipe.seed + 2,
                                slip=recipe.slip_fraction):
        if rng.random() < recipe.plain_answer_fraction:
            body = s.extra["answer"].rsplit("\n", 1)[0]
            s = replace(s, extra={**s.extra, "answer": f"{body}\nThe answer is {s.ground_truth}."})
        out.append(s)
    return out


def build_demo_model(out_dir: Path, recipe: TinyRecipe = TinyRecipe(), log=print) -> Path:
    """Build tokenizer + SFT'd tiny Qwen2 into `out_dir`. Built in a temporary folder beside it and renamed
    into place, `recipe.json` last: `out_dir` is never seen half written."""
    t0 = time.time()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same float sums, so the same bytes, on any machine's core count
    try:
        _build(out_dir, recipe, log, t0)
    finally:
        torch.set_num_threads(threads)
    log(f"demo base model ready in {time.time() - t0:.0f}s: {out_dir}")
    return out_dir


def _build(out_dir: Path, recipe: TinyRecipe, log, t0: float) -> None:
    with build_into(out_dir) as tmp:
        tokenizer = build_tokenizer(recipe, tmp)
        model = random_tiny_model(tokenizer, recipe)
        n_params = sum(p.numel() for p in model.parameters())
        log(f"building demo base model: {n_params / 1e6:.2f}M-param Qwen2, SFT {recipe.sft_steps} steps "
            f"x {recipe.sft_batch_size} problems")
        data = sft_data(recipe)

        sft_with_progress("demo base model SFT", model, tokenizer, data, recipe, log, t0, every=50)
        save_built(tmp, model, tokenizer, {**asdict(recipe), "key": recipe.key()})


def sft_with_progress(name: str, model, tokenizer, data, recipe, log, t0: float, every: int) -> None:
    """A demo base model's SFT (`recipe`'s sft_steps, sft_batch_size, sft_lr, seed): a bar on a terminal, and a
    log line every `every` steps everywhere (the build's closing line has its seconds)."""
    from alignrl.models.sft import sft_train

    with Phase(name, recipe.sft_steps, "steps", say=False) as progress:
        def on_step(step: int, loss: float) -> None:
            progress.advance()
            if (step + 1) % every == 0 or step + 1 == recipe.sft_steps:
                log(f"  sft step {step + 1}/{recipe.sft_steps} loss {loss:.3f} ({time.time() - t0:.0f}s)")

        sft_train(model, tokenizer, data, steps=recipe.sft_steps, batch_size=recipe.sft_batch_size,
                  lr=recipe.sft_lr, seed=recipe.seed, on_step=on_step)


@contextmanager
def build_into(out_dir: Path) -> Iterator[Path]:
    """A fresh folder beside `out_dir` to build in; it becomes `out_dir` when the block ends normally and is
    removed when it raises, so `out_dir` is never seen half written."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    try:
        yield tmp
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_built(folder: Path, model, tokenizer, recipe: dict) -> None:
    """Model, tokenizer and, last, the recipe marker: a folder without the marker was never finished."""
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / MARKER).write_text(json.dumps(recipe, indent=2))


def demo_model_problem(path: Path, recipe: TinyRecipe) -> str | None:
    """Why the cached folder at `path` cannot be used (None: it can): no marker (never finished, or
    written by a version that did not build atomically), another recipe, or files missing or broken."""
    from alignrl.models.folder import ModelError, check_model_folder, load_tokenizer

    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError) as exc:
        return f"{MARKER} missing or unreadable ({type(exc).__name__})"
    if not isinstance(marker, dict) or marker.get("key") != recipe.key():
        return f"{MARKER} is for another recipe"
    try:
        check_model_folder(path)
        load_tokenizer(path)
    except ModelError as exc:
        return str(exc)
    return None


@contextmanager
def build_lock(path: Path) -> Iterator[None]:
    """An exclusive lock beside the cache folder: a second builder (another process, another rank) waits
    here and then finds the folder the first one finished. Released by the OS if the holder dies."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def ensure_built(path: Path, recipe, build: Callable[[Path], Path], what: str, log=print) -> Path:
    """`path` when it holds a complete build of `recipe`, else `build(path)` under the build lock (another
    process may have finished it while this one waited)."""
    if demo_model_problem(path, recipe) is None:
        return path
    with build_lock(path):
        problem = demo_model_problem(path, recipe)
        if problem is None:
            return path
        if path.exists():
            log(f"{what} cache {path} is incomplete ({problem}); rebuilding it")
        return build(path)


def shipped_or_built(shipped: Path, recipe, build: Callable[[Path], Path], rebuild_hint: str, what: str,
                     log=print) -> Callable[[Path], Path]:
    """A builder for `ensure_built` that copies `shipped` (a build that ships with the package) when it is a
    complete build of `recipe`, and runs `build` otherwise."""
    def get(path: Path) -> Path:
        if shipped.is_dir() and demo_model_problem(shipped, recipe) is None:
            with build_into(path) as tmp:
                shutil.copytree(shipped, tmp, dirs_exist_ok=True)
            log(f"{what}: the shipped build of recipe {recipe.key()} (rebuild it from its seed with `{rebuild_hint}`)")
            return path
        return build(path)

    return get


def ensure_demo_model(recipe: TinyRecipe = TinyRecipe(), log=print) -> Path:
    """Path of the cached demo model for `recipe`, (re)building it first if it is absent or incomplete. The
    default recipe's build ships with the package (`SHIPPED`): it is copied into the cache instead."""
    build = shipped_or_built(SHIPPED, recipe, lambda path: build_demo_model(path, recipe, log),
                             f"alignrl build-demo-model --seed {recipe.seed}", "demo base model", log)
    return ensure_built(cache_root() / f"demo-{recipe.key()}", recipe, build, "demo model", log)
