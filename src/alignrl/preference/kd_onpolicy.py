"""GKD's on-policy part for `alignrl train kd` (Agarwal et al., TRL's `GKDTrainer`): optimizer steps that train on
generated completions instead of the rows' own.

Once per optimizer step, a draw below `lmbda` (`draws_student`: a generator seeded by the run's seed and the step
alone, so every rank and a resumed run draw the same) makes the step train on the student's own generations; with
`seq_kd` the other steps train on the teacher's; otherwise on the rows' completions. A generated step replaces every
micro-batch of the step before its first backward: each row keeps its prompt (its tokens before its last trained
span: TRL's chat collator prompts with every message before the last), the model samples up to `max_new_tokens`
tokens for it (plain sampling at `temperature`, top_k 0, top_p 1, the tokenizer's eos and pad, none of the model
folder's generation_config; only ids that both models' heads and the tokenizer hold), and the trained tokens are the
sampled ones up to and including the first eos. The step's `global_tokens` is then the generated trained tokens of
the whole step over every rank, what the summed losses are divided by; its loss is the distillation term alone
(`generated`), as TRL's GKD loss on generations is its divergence alone.

TRL draws per call of its trainer's training step (each micro-batch); here the draw is per optimizer step, because
the step's token count, which normalises its loss, must be known before its first backward on every rank.

The wrapper sits around the loader `preference.sft.train_sft` hands `common.train_pairs`: it yields stand-ins whose
`to(device)` prepares their step when the first of them moves, so the micro-batches a resumed run skips are never
generated for. Each row samples from a generator of its own seeded by (seed, step, the row's data set position)
(`row_seed`, `RowSampler`): a row's completion does not depend on the rank, micro-batch or neighbours it has, so two
ranks sample what one process accumulating the same global batch does, and the global random state (dropout's,
which train_pairs keys by the micro-batch) is left as it was. A student sharded over the ranks (FSDP2, ZeRO-3)
generates with `generate`'s synced_gpus: its forwards gather weights from every rank, so every rank runs forwards
until the last rank's rows are done.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from alignrl.config import ConfigError
from alignrl.data.sft_rows import EncodedRow, SFTBatch, collate_rows
from alignrl.preference import common as pc
from alignrl.preference.kd_cli import KDConfig, asked
from alignrl.preference.sft import steps_per_epoch


def draws_student(seed: int, step: int, lmbda: float) -> bool:
    """Whether optimizer step `step` (counted from 0 over the whole run) trains on the student's generations: a
    uniform draw below `lmbda` from a generator seeded by (seed, step) alone. lmbda 0 never, 1 always."""
    if lmbda <= 0.0:
        return False
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step * 7_919 + 104_729) % 2**63)
    return float(torch.rand(1, generator=gen)) < lmbda


def check_rows(encoded: list[EncodedRow], cfg: KDConfig) -> None:
    """Each row needs a prompt to generate from: rows trained from their first token (plain text, pretrain_mode,
    completion_only_loss=false, conversations with assistant_only_loss=false) or with images are one line."""
    for e in encoded:
        why = ("has no prompt: its first token trains (text rows, pretrain_mode, completion_only_loss=false, or "
               "conversations trained whole); give prompt-completion rows, or conversations with "
               "assistant_only_loss=true" if e.trained and e.trained[0] else
               "has images (generation here is text-only); give rows without images" if e.images is not None else "")
        if why:
            raise ConfigError(f"{asked(cfg)} generates a completion for each row's prompt, and training row "
                              f"{e.index} {why}, or set lmbda=0 and seq_kd=false")


def prompts_of(batch: SFTBatch) -> list[list[int]]:
    """Each row's tokens before its last trained span (a conversation's turns before its last trained one)."""
    out = []
    for ids, trained in zip(batch.input_ids.tolist(), batch.loss_mask.tolist()):
        start = len(trained) - trained[::-1].index(True) if True in trained else len(ids)  # past its last trained
        while start > 0 and trained[start - 1]:
            start -= 1
        out.append(ids[:start])
    return out


def cut_at_eos(tokens: list[int], eos: int) -> list[int]:
    """The sampled tokens up to and including the first eos (all of them without one): what trains."""
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def row_seed(seed: int, step: int, row: int) -> int:
    """The seed of a row's completion at optimizer step `step`: (seed, step, the row's data set position) alone, so a
    row samples the same whatever rank, micro-batch and neighbours it has, and a resumed run samples what the whole
    run did; the same row in another epoch (another step) samples anew."""
    return (seed * 1_000_003 + step * 7_919 + row * 104_729 + 15_485_863) % 2**63


@torch.no_grad()
def sample(model, prompts: list[list[int]], pad: int, eos: int, cfg: KDConfig, device: torch.device,
           seeds: list[int], limit: int | None = None, synced: bool = False) -> list[list[int]]:
    """Each prompt's sampled completion (`cut_at_eos`), row r's tokens drawn from a generator seeded by `seeds[r]`
    (`RowSampler`); the prompts left-padded for `generate`, the model in eval mode for it (no dropout) and back as
    it was; ids from `limit` on never drawn (entries beyond the tokenizer, or beyond the other model's head).
    `synced`: the model's weights are sharded over the ranks (FSDP2, ZeRO-3), whose forwards are collectives, so
    every rank runs forwards until the last rank's rows are done (`generate`'s synced_gpus)."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):], mask[r, width - len(p):] = torch.tensor(p, dtype=torch.long), 1
    was = model.training
    model.eval()
    try:
        from transformers import LogitsProcessorList

        # greedy decoding of the scores RowSampler leaves: its pick at 0, every other id at -inf
        with pc.autocast(cfg, device), _plain_sampling(model):
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                 max_new_tokens=cfg.max_new_tokens, pad_token_id=pad, eos_token_id=eos,
                                 use_cache=True, synced_gpus=synced,
                                 logits_processor=LogitsProcessorList([RowSampler(seeds, cfg.temperature, limit)]))
    finally:
        model.train(was)
    return [cut_at_eos(row, eos) for row in out[:, width:].tolist()]


class RowSampler:
    """`generate`'s logits processor that samples: each row's next token drawn from softmax(scores / temperature)
    (top_k 0, top_p 1) with a generator of the row's own, the other ids then set to -inf for greedy decoding to take
    it. One generator per row, not the batch's shared random state, makes a row's completion independent of the
    batch it sits in: one process and several ranks, any gradient accumulation, sample the same rows alike."""

    def __init__(self, seeds: list[int], temperature: float, limit: int | None = None):
        self.seeds, self.temperature, self.limit, self.generators = seeds, temperature, limit, None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.generators is None:  # on the scores' device, made at the first token
            self.generators = [torch.Generator(device=scores.device).manual_seed(s) for s in self.seeds]
        logits = scores.float() / self.temperature
        if self.limit is not None:
            logits[:, self.limit:] = float("-inf")
        probs = torch.softmax(logits, dim=-1)
        picks = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, self.generators)])
        return torch.full_like(scores, float("-inf")).scatter_(1, picks[:, None], 0.0)


@contextmanager
def _plain_sampling(model):
    """The model folder's generation_config set aside while sampling: `generate` fills what it is not given from it
    (Qwen2.5-Instruct's repetition_penalty 1.05, a no_repeat_ngram_size, min_p, ...), and the samples are plain
    sampling at `temperature`. Every module that holds one gets a fresh config (a LoRA student's wrapped model too:
    PEFT's generate hands the inner model's config on)."""
    owners = [m for m in model.modules() if "generation_config" in vars(m)]
    saved = [m.generation_config for m in owners]
    if owners:
        from transformers import GenerationConfig

        for m in owners:
            m.generation_config = GenerationConfig()
    try:
        yield
    finally:
        for m, config in zip(owners, saved):
            m.generation_config = config


@dataclass
class _Pending:
    """Micro-batch `k` of a step, prepared when it is moved to the device (as train_pairs moves each batch)."""

    step: _Step
    k: int

    def to(self, device: torch.device, non_blocking: bool = False) -> SFTBatch:
        return self.step.batch(self.k, device, non_blocking)


class _Step:
    """One optimizer step's micro-batches of this rank, generated for (or kept) all at once."""

    def __init__(self, owner: OnPolicy, batches: list[SFTBatch], index: int):
        self.owner, self.batches, self.index, self.ready = owner, batches, index, None

    def batch(self, k: int, device: torch.device, non_blocking: bool) -> SFTBatch:
        if self.ready is None:
            self.ready = self.owner.prepare(self.batches, self.index, device, non_blocking)
        return self.ready[k]


class OnPolicy:
    """The loader wrapper (`train_sft`'s `batches` seam, `check` its `check_rows`) and the current step's metrics.
    `teacher` and `limit` are set by the distillation objective once it has loaded the teacher (seq_kd generates with
    it; `limit`: the ids below both heads and the tokenizer). `generated`: the current step trains on generations."""

    def __init__(self, cfg: KDConfig):
        self.cfg, self.teacher, self.student, self.env, self.tok = cfg, None, None, None, None
        self.limit: int | None = None
        self.generated, self.sharded = False, False
        self.now = {"on_policy": 0.0, "completion_length": 0.0}

    def check(self, encoded: list[EncodedRow]) -> None:
        """The training rows' layout (`check_rows`), before any model loads."""
        check_rows(encoded, self.cfg)

    def metrics(self) -> dict[str, float]:
        """The current step's: on_policy 1 on the student's generations, else 0; completion_length, the mean
        trained tokens of its rows' completions (generated ones on a generated step)."""
        return dict(self.now)

    def __call__(self, loader, engine, encoded: list[EncodedRow], tok, env, log):
        self.student, self.env, self.tok = engine.model, env, tok  # the unwrapped module: DDP's hooks stay out
        # FSDP2's or ZeRO-3's student: its forwards gather the weights from every rank
        self.sharded = env.world_size > 1 and not getattr(engine, "whole_weights", True)
        from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

        if self.sharded and isinstance(engine.model, FSDPModule):  # a PEFT model's generate skips the root's forward
            register_fsdp_forward_method(engine.model, "generate")  # (its weights would stay sharded): hooked too
        cfg = self.cfg
        log.print(f"on-policy distillation: each optimizer step trains on the student's generations with chance "
                  f"lmbda={cfg.lmbda:g}" + (", on the teacher's otherwise" if cfg.seq_kd else "")
                  + f"; sampled at temperature {cfg.temperature:g}, top_k 0, top_p 1, at most {cfg.max_new_tokens} "
                  "new tokens, trained up to and including the first eos, on distil_loss alone (GKD's loss)")
        per_epoch = steps_per_epoch(len(encoded), cfg, env.world_size)
        return lambda epoch: self._pending(loader(epoch), epoch * per_epoch)

    def _pending(self, batches, first_step: int):
        accum, it = self.cfg.gradient_accumulation_steps, iter(batches)
        for index in itertools.count(first_step):
            group = list(itertools.islice(it, accum))
            if not group:
                return
            step = _Step(self, group, index)
            yield from (_Pending(step, k) for k in range(len(group)))

    def prepare(self, batches: list[SFTBatch], index: int, device: torch.device, non_blocking: bool
                ) -> list[SFTBatch]:
        """The step's micro-batches on `device`: the rows' own, or generated by the student (the draw) or the
        teacher (seq_kd), their global_tokens the generated trained tokens of the step on every rank."""
        student = draws_student(self.cfg.seed, index, self.cfg.lmbda)
        model = self.student if student else self.teacher if self.cfg.seq_kd else None
        self.generated = model is not None
        if model is None:
            rows = sum(b.n_rows for b in batches)
            self.now = {"on_policy": 0.0, "completion_length": sum(float(b.loss_mask.sum()) for b in batches) / rows}
            return [b.to(device, non_blocking=non_blocking) for b in batches]
        made = [self._generated(model, b, index, device) for b in batches]
        from alignrl.runtime.env import all_reduce_sum

        mine = [sum(len(e.ids) - len(p) for e, p in rows) for rows in made]
        (tokens,) = all_reduce_sum(self.env, [float(sum(mine))])
        self.now = {"on_policy": float(student), "completion_length": sum(mine) / sum(len(r) for r in made)}
        pad = self.tok.pad_token_id
        return [collate_rows([e for e, _ in rows], pad, tokens).to(device) for rows in made]

    def _generated(self, model, batch: SFTBatch, index: int, device: torch.device):
        """[(the row of prompt + generated completion, its prompt)] for the micro-batch's rows, each row sampled from
        its own seed (`row_seed`)."""
        prompts, rows = prompts_of(batch), batch.index.tolist()
        from torch.distributed.fsdp import FSDPModule

        # a sharded model's forwards gather its weights from every rank: the student under fsdp2 or ZeRO-3, the
        # teacher under both too, as FSDP2 shards (kd.sharded_teacher, beside a DeepSpeed student as well); whole on
        # each rank otherwise
        synced = self.sharded if model is self.student else isinstance(model, FSDPModule)
        made = sample(model, prompts, self.tok.pad_token_id, self.tok.eos_token_id, self.cfg, device,
                      [row_seed(self.cfg.seed, index, int(i)) for i in rows], self.limit, synced)
        return [(EncodedRow(p + c, [False] * len(p) + [True] * len(c), int(i)), p)
                for p, c, i in zip(prompts, made, rows)]
