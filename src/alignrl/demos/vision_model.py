"""The vision demo's base model: a tiny Qwen2-VL (`models.tiny_vl`) SFT'd from its seed on the counting task, with
room left for RL, and the sampling evaluation the demo measures it with.

The SFT targets are the R1 form of the answer (`<think>...</think><answer>N</answer>`). First they are right, until
the model sees and counts; then, like an over-counting annotator's, `slip_fraction` of them are one too high. The
model keeps counting but answers one too many: its greedy answer is almost always wrong while its samples are right
about a quarter of the time (pass@8 far above pass@1), the room that RL from the answer reward turns into accuracy.
Built once per recipe and cached under `$ALIGNRL_CACHE` (`vision-demo-<recipe key>`), like
the GSM8K demo's base (`models.tiny`: marker file last, atomic rename, build lock).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from alignrl.demos.vision_data import MAX_COUNT, Picture, draw, messages, response, sft_pictures, tokenizer_texts
from alignrl.models.tiny import MARKER, build_into, cache_root, ensure_built
from alignrl.models.tiny_vl import TinyVLRecipe
from alignrl.utils.progress import Phase


@dataclass(frozen=True)
class VisionRecipe:
    seed: int = 0
    arch: TinyVLRecipe = field(default_factory=lambda: TinyVLRecipe(hidden_size=96, intermediate_size=192,
                                                                    vision_embed_dim=48, vocab_size=384))
    sft_pictures: int = 4000
    count_steps: int = 400  # phase 1: right answers only, until the model sees and counts
    slip_steps: int = 200  # phase 2: an over-counting annotator's answers, which the model learns to copy
    sft_batch_size: int = 32
    sft_lr: float = 3e-3
    slip_lr: float = 1e-3
    slip_fraction: float = 0.75  # phase 2 targets one too high

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def slipped(p: Picture, rng: random.Random, fraction: float) -> int:
    """The annotator's count: one too many `fraction` of the time (the annotator over-counts), else right."""
    return min(MAX_COUNT + 1, p.count + 1) if rng.random() < fraction else p.count


def prompt_batch(processor, pics: Sequence[Picture]) -> dict:
    """Left-padded prompt ids and the pictures' pixel values (the processor's output for the chat prompts)."""
    processor.tokenizer.padding_side = "left"
    texts = [processor.apply_chat_template(messages(None, p), add_generation_prompt=True, tokenize=False)
             for p in pics]
    return dict(processor(text=texts, images=[draw(p) for p in pics], return_tensors="pt", padding=True))


def sft_loss(model, processor, pics: Sequence[Picture], targets: Sequence[str]) -> torch.Tensor:
    """Mean token cross-entropy of `targets` (each then eos) after the prompts of `pics`."""
    tok = processor.tokenizer
    enc = prompt_batch(processor, pics)
    rows = [tok(t + tok.eos_token, add_special_tokens=False)["input_ids"] for t in targets]
    width = max(map(len, rows))
    tgt = torch.full((len(rows), width), tok.pad_token_id)
    tmask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        tgt[i, :len(r)], tmask[i, :len(r)] = torch.tensor(r), 1
    ids = torch.cat([enc["input_ids"], tgt], 1)
    mask = torch.cat([enc["attention_mask"], tmask], 1)
    kinds = torch.cat([enc["mm_token_type_ids"], torch.zeros_like(tgt)], 1)  # which tokens are image tokens
    logits = model(input_ids=ids, attention_mask=mask, pixel_values=enc["pixel_values"],
                   image_grid_thw=enc["image_grid_thw"], mm_token_type_ids=kinds).logits
    start = enc["input_ids"].shape[1]
    pred = logits[:, start - 1:-1].float().log_softmax(-1)
    lp = pred.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    return -(lp * tmask).sum() / tmask.sum()


def sft(model, processor, recipe: VisionRecipe, log=print, t0: float | None = None) -> None:
    """Phase 1 on right answers, then phase 2 on answers `slip_fraction` of which are one too high. Counting is
    learnt suddenly after a plateau, and only from right answers (with slipped ones from the start it was not learnt
    within the budget); phase 2 keeps the counting and shifts the answer."""
    from alignrl.core.optim import build_optimizer

    t0 = time.time() if t0 is None else t0
    rng = random.Random(recipe.seed)
    pics = sft_pictures(recipe.sft_pictures, recipe.seed)
    total = recipe.count_steps + recipe.slip_steps
    model.train()
    done = 0
    with Phase("vision demo base model SFT", total, "steps", say=False) as progress:  # the log has its lines
        for steps, lr, slip in ((recipe.count_steps, recipe.sft_lr, 0.0), (recipe.slip_steps, recipe.slip_lr,
                                                                          recipe.slip_fraction)):
            if not steps:
                continue
            targets = [response(p.colour, slipped(p, rng, slip)) for p in pics]
            opt, sched = build_optimizer(model.parameters(), lr, 0.0, (0.9, 0.95), min(20, steps // 5), steps,
                                         "cosine", 0.1)
            for _ in range(steps):
                idx = rng.sample(range(len(pics)), recipe.sft_batch_size)
                loss = sft_loss(model, processor, [pics[i] for i in idx], [targets[i] for i in idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                done += 1
                progress.advance()
                if done % 100 == 0 or done == total:
                    log(f"  sft step {done}/{total} loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
    model.eval()


def build_vision_model(out_dir: Path, recipe: VisionRecipe = VisionRecipe(), log=print) -> Path:
    """The tiny Qwen2-VL of `recipe.arch`, SFT'd, into `out_dir` (built beside it, renamed into place, marker last)."""
    from alignrl.models.tiny_vl import build_tiny_vl
    from alignrl.models.vision import load_processor, load_vision_model, save_processor

    t0 = time.time()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same float sums, so the same model, on any machine
    try:
        with build_into(out_dir) as tmp:
            raw = build_tiny_vl(tmp / "random", seed=recipe.seed, texts=tokenizer_texts(), recipe=recipe.arch)
            processor, model = load_processor(raw), load_vision_model(raw)
            n = sum(p.numel() for p in model.parameters())
            log(f"building vision demo base model: {n / 1e6:.2f}M-param Qwen2-VL, SFT {recipe.count_steps} steps "
                f"on right counts, then {recipe.slip_steps} with {recipe.slip_fraction:.0%} of them one off, "
                f"{recipe.sft_batch_size} pictures a step")
            sft(model, processor, recipe, log, t0)
            model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
            model.config.use_cache = True
            model.save_pretrained(tmp)
            save_processor(processor, tmp)
            shutil.rmtree(raw)  # the random model it started from
            (tmp / MARKER).write_text(json.dumps({**asdict(recipe), "key": recipe.key()}, indent=2))
    finally:
        torch.set_num_threads(threads)
    log(f"vision demo base model ready in {time.time() - t0:.0f}s: {out_dir}")
    return out_dir


def ensure_vision_model(recipe: VisionRecipe = VisionRecipe(), log=print) -> Path:
    """The cached base model of `recipe`, built first when absent or incomplete."""
    return ensure_built(cache_root() / f"vision-demo-{recipe.key()}", recipe,
                        lambda path: build_vision_model(path, recipe, log), "vision demo model", log)


def evaluate(folder: str | Path, pics: Sequence[Picture], k: int = 8, batch: int = 64, max_new_tokens: int = 24,
             seed: int = 0, processor_folder: str | Path | None = None) -> dict[str, float]:
    """Greedy accuracy (what the loop's held-out accuracy measures), and from `k` samples at temperature 1 per picture:
    sampled accuracy (pass@1, the mean over the samples), pass@k and the share of samples in the R1 format.
    `processor_folder`: where the processor is (training does not change it; default `folder`)."""
    from alignrl.models.vision import load_processor, load_vision_model
    from alignrl.rewards.think_answer import accuracy, format_ok

    processor, model = load_processor(processor_folder or folder), load_vision_model(folder).eval()
    model.config.use_cache = True
    tok = processor.tokenizer
    torch.manual_seed(seed)
    greedy = sampled = any_right = formatted = 0.0
    for s in range(0, len(pics), batch):
        part = pics[s:s + batch]
        enc = prompt_batch(processor, part)
        width = enc["input_ids"].shape[1]
        with torch.no_grad():
            g = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            x = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, top_k=0,
                               top_p=1.0, num_return_sequences=k, pad_token_id=tok.pad_token_id)
        g_text = tok.batch_decode(g[:, width:], skip_special_tokens=True)
        x_text = tok.batch_decode(x[:, width:], skip_special_tokens=True)
        for i, p in enumerate(part):
            greedy += accuracy(g_text[i], str(p.count))
            right = [accuracy(t, str(p.count)) for t in x_text[i * k:(i + 1) * k]]
            sampled += sum(right) / k
            any_right += max(right)
            formatted += sum(format_ok(t) for t in x_text[i * k:(i + 1) * k]) / k
    n = max(1, len(pics))
    return {"accuracy": round(greedy / n, 4), "sampled_accuracy": round(sampled / n, 4),
            f"pass@{k}": round(any_right / n, 4), "format_rate": round(formatted / n, 4)}
