"""Supervised fine-tuning (`alignrl train sft`): the step before a reward model and RL, as OpenRLHF's `train_sft`,
TRL's `SFTTrainer` and verl's `fsdp_sft_trainer` run it.

    alignrl train sft train_files=[data/train.jsonl] eval_files=[data/test.jsonl] --output_dir models/sft --nproc 2

The causal LM trains through a TrainEngine (one process, DDP, FSDP2 or DeepSpeed; with `use_lora`, its LoRA adapters
alone) on the rows of `data.sft_rows` (conversations, prompt-completion, plain text). The loss is the token mean of
the cross-entropy over the trained tokens of the whole optimizer step: every micro-batch's summed loss is divided by
the trained tokens of all micro-batches on all ranks of its step, which every rank works out from the seeded data
order (`common.micro_batches`), so gradient accumulation and more ranks give the update of one big batch.

The held-out rows' token-mean loss and perplexity are measured before and after training (and every `eval_steps`)
and written to `<output_dir>/eval_results.json` beside the saved HF causal-LM folder and its tokenizer, which
`alignrl train grpo model.path=<output_dir>` loads. `save_steps` writes resumable checkpoints and `resume_from` goes
on from one (`preference.checkpoints`). `packing` lays a micro-batch's rows end to end with restarting position ids
(the same rows, loss and update, without the padding); with `packing_strategy` bfd, bfd_split or wrapped it packs
the whole training set before batching instead, as TRL's packing=True does, and `batch_size` then counts packed rows.
`eval_packing` (TRL's; unset: as `packing`) packs the held-out rows the same way.
`neftune_noise_alpha` adds NEFTune's noise to the input embeddings in training (`preference.sft_packing`). Rows with
images train a vision-language model (Qwen2-VL) with its images in the forward (`preference.sft_vision`). Left out:
Liger kernels.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import replace

import torch

from alignrl.data.blend import read_files
from alignrl.data.sft_rows import EncodedRow, SFTBatch, SFTKeys, SFTRow, collate_rows, encode_rows, load_rows
from alignrl.preference import adapters
from alignrl.preference import checkpoint_plan as cp
from alignrl.preference import common as pc
from alignrl.preference import sft_vision as vision
from alignrl.preference.sft_cli import SFTConfig, eval_packs, packs_dataset
from alignrl.preference.sft_packing import (NEFTune, check_packable, collate_bins, collate_packed, one_row_attention,
                                            pack_dataset)


def _keys(cfg: SFTConfig, chat_template: bool) -> SFTKeys:
    return SFTKeys(cfg.prompt_key, cfg.response_key, cfg.messages_key, cfg.text_key, chat_template,
                   cfg.completion_only_loss, cfg.assistant_only_loss, cfg.input_template, cfg.image_key,
                   cfg.tools_key, cfg.enable_thinking_key, tuple(cfg.prompt_dict_keys), tuple(cfg.response_dict_keys))


def _load(files: list[str], keys: SFTKeys, limit: int, key: str, probs=(), seed: int = 42) -> list[SFTRow]:
    """The rows of `files`, the first `limit` of them all (OpenRLHF's --max_samples: of the blend, not of each file;
    0: all), concatenated or blended by `probs` (`read_files`)."""
    return [row for _, row in read_files(files, lambda f, n: load_rows(str(f), keys, n, key), limit or None, probs,
                                         seed, key)]


def collator(cfg: SFTConfig, pad_id: int, model=None, packed: bool | None = None):
    """`collate(rows, global_tokens) -> SFTBatch`: padded, or `packed` (default: `packing`) into sequences of at
    most max_length tokens (all in one row for flash attention, `sft_packing.one_row_attention`); rows packed before
    batching (bfd, bfd_split) each a sequence of their own, wrapped ones padded (attention crosses their rows)."""
    if not (cfg.packing if packed is None else packed) or cfg.packing_strategy == "wrapped":
        return lambda rows, tokens: collate_rows(rows, pad_id, tokens)
    one_row = model is not None and one_row_attention(model)
    if cfg.packing_strategy in SPLIT_OR_BINNED:
        return lambda rows, tokens: collate_bins(rows, pad_id, tokens, one_row)
    return lambda rows, tokens: collate_packed(rows, pad_id, tokens, cfg.max_length, one_row)


SPLIT_OR_BINNED = ("bfd", "bfd_split")  # rows packed before batching, each kept to itself
UNCUT = ("bfd_split", "wrapped")  # strategies that take a row longer than max_length whole and cut it themselves
QUIET = type("Quiet", (), {"print": staticmethod(lambda *_, **__: None)})()  # a dry run's log: silent


def _check_enough(n_rows: int, cfg: SFTConfig, world: int) -> None:
    """At least one global batch of rows; a packed dataset trains from one row (a partial step, as transformers'
    Trainer takes the last partial batch)."""
    if not packs_dataset(cfg) or n_rows == 0:
        pc.check_enough(n_rows, cfg, world, ", ".join(map(str, cfg.train_files)))


def pack_rows(encoded: list[EncodedRow], cfg: SFTConfig, log, notes: dict, held_out: bool = False
              ) -> list[EncodedRow]:
    """The training (`held_out`: held-out) rows as the batches take them: as they are, or packed
    (`sft_packing.pack_dataset`)."""
    if not encoded or cfg.packing_strategy == "micro_batch" or not (eval_packs(cfg) if held_out else
                                                                    packs_dataset(cfg)):
        return encoded  # no rows (no held-out files): nothing to pack or to say
    packed, dropped = pack_dataset(encoded, cfg.max_length, cfg.packing_strategy)
    long = [len(e.ids) for e in encoded if len(e.ids) > cfg.max_length] if cfg.packing_strategy == "bfd_split" else []
    split = (f" ({len(long)} longer than max_length cut into {sum(-(-n // cfg.max_length) for n in long)} pieces, "
             "each packed as a row)") if long else ""
    which, size = ("held-out ", "eval_batch_size") if held_out else ("", "batch_size")
    log.print(f"packing ({cfg.packing_strategy}): {len(encoded)} {which}rows{split} into {len(packed)} packed rows "
              f"of at most max_length={cfg.max_length} tokens, before batching; {size} counts packed rows"
              + (f"; {dropped} packed rows with no trained token dropped" if dropped else ""))
    notes["eval_packed_rows" if held_out else "packed_rows"] = len(packed)
    return packed


def schedule(n: int, cfg: SFTConfig, world: int, rank: int, epoch: int) -> list[list[int]]:
    """This rank's micro-batches of `epoch`: positions of the training rows, -1 a filler (a row trained nowhere).
    `common.micro_batches`' whole global batches, the rest of the rows dropped; with the dataset packed (TRL's
    packing) the rest is one more step, as transformers' Trainer keeps a last partial batch: its rows go round the
    ranks in the epoch's seeded order, then into the rank's micro-batches, one with no row left running a filler."""
    from torch.utils.data import DistributedSampler

    batches = pc.micro_batches(n, cfg, world, rank, epoch)
    if not packs_dataset(cfg) or n % pc.global_batch(cfg, world) == 0:
        return batches
    # micro_batches' whole global batches take the first of the seeded order, the same on every rank
    order = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=cfg.seed)
    order.set_epoch(epoch)
    mine, size = list(order)[n - n % pc.global_batch(cfg, world):][rank::world], cfg.batch_size
    return batches + [mine[k * size:(k + 1) * size] or [-1] for k in range(cfg.gradient_accumulation_steps)]


def steps_per_epoch(n: int, cfg: SFTConfig, world: int) -> int:
    """Optimizer steps of one epoch: whole global batches, and with the dataset packed a last partial one too."""
    whole = pc.steps_per_epoch(n, cfg, world)
    return whole + (packs_dataset(cfg) and n % pc.global_batch(cfg, world) > 0)


def _row(encoded: list[EncodedRow], j: int) -> EncodedRow:
    """Row `j`, or for -1 a filler: the first row's tokens (and images), none of them trained."""
    return encoded[j] if j >= 0 else replace(encoded[0], trained=[False] * len(encoded[0].ids), index=-1)


def step_tokens(encoded: list[EncodedRow], cfg: SFTConfig, world: int, epoch: int) -> list[float]:
    """The trained tokens of each optimizer step of `epoch`, over every micro-batch of every rank."""
    accum = cfg.gradient_accumulation_steps
    counts: list[float] = []
    for rank in range(world):
        for i, batch in enumerate(schedule(len(encoded), cfg, world, rank, epoch)):
            if i // accum == len(counts):
                counts.append(0.0)
            counts[i // accum] += sum(encoded[j].n_trained for j in batch if j >= 0)
    return counts


def train_batches(encoded: list[EncodedRow], collate, cfg: SFTConfig, env):
    """`loader(epoch)` for `common.train_pairs`: this rank's micro-batches, each knowing its step's global count."""
    from torch.utils.data import DataLoader

    def loader(epoch: int):
        counts = step_tokens(encoded, cfg, env.world_size, epoch)
        mine = schedule(len(encoded), cfg, env.world_size, env.rank, epoch)
        items = [(batch, counts[i // cfg.gradient_accumulation_steps]) for i, batch in enumerate(mine)]
        # a generator of its own: the loader's seed draw leaves the global random state (dropout's) alone
        return DataLoader(items, batch_size=None, num_workers=cfg.num_workers, pin_memory=env.device.type == "cuda",
                          generator=torch.Generator().manual_seed(cfg.seed),
                          collate_fn=lambda item: collate([_row(encoded, j) for j in item[0]], item[1]))

    return loader


def eval_batches(encoded: list[EncodedRow], collate, batch_size: int, env) -> list:
    """This rank's share of the held-out rows (rank::world), padded with untrained copies so that every rank runs the
    same number of forwards (sharded engines need all ranks in each one); batches with images are collated when they
    run (`sft_vision.held_out_batch`)."""
    mine = encoded[env.rank::env.world_size]
    per_rank = -(-len(encoded) // env.world_size)
    filler = _row(encoded, -1) if encoded else None
    mine = mine + [filler] * (per_rank - len(mine))
    return [vision.held_out_batch(collate, mine[i:i + batch_size]) for i in range(0, len(mine), batch_size)]


def trained_logits(model, batch: SFTBatch, cfg: SFTConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the float32 logits of the batch's trained positions [N, V], the tokens they predict [N]). Position t predicts
    token t + 1; the trained positions' logits alone go to float32. A packed batch goes in with its position ids and
    no attention mask, from which transformers builds the block-diagonal mask that keeps its rows apart. A batch
    with images takes them into the forward (`sft_vision`). Any causal LM of the tokenizer (a teacher too)."""
    with pc.autocast(cfg, device), vision.forward_images(model, batch):
        if batch.position_ids is None:
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long(),
                           use_cache=False, **vision.image_inputs(model, batch)).logits
        else:
            logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    targets = batch.loss_mask[:, 1:]
    return logits[:, :-1][targets].float(), batch.input_ids[:, 1:][targets]


def summed_loss(model, batch: SFTBatch, cfg: SFTConfig, device: torch.device) -> tuple[torch.Tensor, int]:
    """(the summed cross-entropy of the batch's trained tokens, their number)."""
    picked, labels = trained_logits(model, batch, cfg, device)
    return torch.nn.functional.cross_entropy(picked, labels, reduction="sum"), labels.numel()


@torch.no_grad()
def evaluate(model, batches: list, cfg: SFTConfig, env) -> dict[str, float]:
    """The held-out token-mean loss over all ranks' shares, and its perplexity."""
    from alignrl.runtime.env import all_reduce_sum

    was = model.training
    model.eval()
    sums = [0.0, 0.0]
    for batch in batches:
        batch = batch() if callable(batch) else batch  # one with images: its pixels loaded now, dropped after
        total, n = summed_loss(model, batch.to(env.device), cfg, env.device)
        sums = [sums[0] + float(total), sums[1] + n]
    model.train(was)
    total, tokens = all_reduce_sum(env, sums)
    loss = total / max(tokens, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": int(tokens)}


class SFTLog(pc.RankZeroLog):
    """The shared log, with the step metrics recorded as train/* (eval/* as given)."""

    def metrics(self, step: int, metrics: dict[str, float]) -> None:
        super().metrics(step, {k if "/" in k else f"train/{k}": v for k, v in metrics.items()})


def _encode(tok, cfg: SFTConfig, train_rows: list[SFTRow], eval_rows: list[SFTRow], log):
    keys = _keys(cfg, pc.string_rows_templated(cfg, tok))
    # wrapped and bfd_split packing cut the rows' tokens at every max_length themselves, as TRL's: a longer row is
    # not cut at its end first
    uncut = cfg.packing_strategy in UNCUT
    vision.check_not_packed(train_rows, cfg.packing, "training")  # before any row is encoded
    vision.check_not_packed(eval_rows, eval_packs(cfg), "held-out")
    enc_train, cut, dropped = _encoded(tok, train_rows, keys, cfg, uncut and packs_dataset(cfg), "training")
    enc_eval, _, _ = _encoded(tok, eval_rows, keys, cfg, uncut and eval_packs(cfg), "held-out")
    trained = sum(e.n_trained for e in enc_train)
    log.print(f"SFT: {len(enc_train)} train rows from {', '.join(map(str, cfg.train_files))} ({trained} trained "
              f"tokens), {len(enc_eval)} held-out; string rows through the chat template: {keys.chat_template}; "
              f"{cut} rows longer than max_length={cfg.max_length} cut at its "
              f"{'start' if cfg.truncation == 'left' else 'end'}"
              + (f", {dropped} of them dropped: no trained token left" if dropped else "")
              + (f"; {vision.with_images(enc_train)} train rows with images" if vision.with_images(enc_train) else ""))
    return enc_train, enc_eval, {"truncated_rows": cut, "dropped_rows": dropped, "chat_template": keys.chat_template,
                                 "image_rows": vision.with_images(enc_train) + vision.with_images(enc_eval)}


def _encoded(tok, rows: list[SFTRow], keys: SFTKeys, cfg: SFTConfig, whole: bool, which: str):
    """encode_rows' (rows, cut, dropped) with `truncation` (verl's data.truncation): right cuts a longer row at its
    end, left keeps its last max_length tokens, error stops the run naming the longer rows; `whole`: packing cuts
    them itself."""
    if whole or cfg.truncation == "right":
        return vision.images_untrained(encode_rows(tok, rows, keys, sys.maxsize if whole else cfg.max_length))
    encoded, _, _ = vision.images_untrained(encode_rows(tok, rows, keys, sys.maxsize))
    longer = [e for e in encoded if len(e.ids) > cfg.max_length]
    if longer and cfg.truncation == "error":
        from alignrl.config import ConfigError

        raise ConfigError(f"{len(longer)} {which} rows are longer than max_length={cfg.max_length} tokens (the "
                          f"longest {max(len(e.ids) for e in longer)}) and truncation=error (verl's default): raise "
                          "max_length, or set truncation=right (cut at the end) or left (keep the end)")
    kept = [vision.cut_left(e, cfg.max_length) if len(e.ids) > cfg.max_length else e for e in encoded]
    out = [replace(e, index=i) for i, e in enumerate(k for k in kept if k.n_trained)]
    return out, len(longer), len(kept) - len(out)


def train_sft(cfg: SFTConfig, dry_run_world: int | None = None, objective=None, batches=None, check_rows=None) -> dict:
    """`objective(cfg, model, tok, env, log, notes) -> summed(module, batch) -> (loss, sums[, means])`: the
    micro-batch's summed loss over its trained tokens, other sums logged as token means, `means` as they are (kd's);
    None: the cross-entropy alone. `batches(loader, engine, encoded, tok, env, log) -> loader` trains in place of the
    rows' micro-batches; `check_rows(encoded)` refuses rows before any model loads, a dry run's too (kd_onpolicy's)."""
    from alignrl.runtime.env import barrier, init_distributed, shutdown

    raw_keys = _keys(cfg, bool(cfg.apply_chat_template))  # rows with images ask for it as they are read
    train_rows = _load(list(cfg.train_files), raw_keys, cfg.max_train_pairs, "train_files", cfg.train_files_probs,
                       cfg.seed)
    eval_rows = _load(list(cfg.eval_files), raw_keys, cfg.max_eval_pairs, "eval_files")
    if dry_run_world:
        _check_enough(len(train_rows), cfg, dry_run_world)
        if check_rows is not None:  # the rows' layout too, before any process starts
            check_rows(_encode(_tokenizer(cfg, QUIET)[1], cfg, train_rows, [], QUIET)[0])
        return {}
    out_dir, log_dir = pc.run_folders(cfg, "models/sft", "logs/training/sft")
    t0 = time.time()
    env = init_distributed()
    log = SFTLog(env, log_dir, cfg.report_to)
    folder, tok = _tokenizer(cfg, log)
    enc_train, enc_eval, notes = _encode(tok, cfg, train_rows, eval_rows, log)
    if check_rows is not None:
        check_rows(enc_train)
    n_rows = len(enc_train)
    _check_enough(n_rows, cfg, env.world_size)
    enc_train = pack_rows(enc_train, cfg, log, notes)  # fewer packed rows than a global batch: one partial step
    enc_eval = pack_rows(enc_eval, cfg, log, notes, held_out=True)
    policy, model, spec = pc.trainable_causal_lm(cfg, folder, log, env.device)
    collate, neft = _layout(cfg, tok.pad_token_id, model, log)
    summed_of = objective(cfg, model, tok, env, log, notes) if objective else (
        lambda module, batch: (summed_loss(module, batch, cfg, env.device)[0], {}))
    per_epoch = steps_per_epoch(len(enc_train), cfg, env.world_size)
    total = min(cfg.max_steps or per_epoch * cfg.epochs, per_epoch * cfg.epochs)
    engine = pc.build_engine_for(cfg, model, env, total)
    rows = "packed rows" if packs_dataset(cfg) else "rows"
    log.print(f"{pc.describe_batch(cfg, env.world_size).replace('pairs', rows)}; {total} optimizer steps, "
              f"strategy {engine.name}, world size {env.world_size}, bf16 {pc.use_bf16(cfg)}")
    evals = eval_batches(enc_eval, collator(cfg, tok.pad_token_id, model, eval_packs(cfg)), cfg.eval_batch_size, env)
    ev = (lambda: evaluate(engine.model, evals, cfg, env)) if enc_eval else (lambda: None)  # noqa: E731
    before = ev()
    if before:
        log.print(f"held-out before training: loss {before['loss']:.4f}, perplexity {before['perplexity']:.3f}")
    plan = cp.plan_for(cfg, out_dir, total, per_epoch)
    start = cp.resumed_step(cfg, plan, engine, "kd" if objective is not None else "sft", log, env)
    export = adapters.exporter(policy, model, spec, cfg.lora_export)

    def after_step(step: int) -> dict[str, float]:  # collective: every rank reaches the same steps
        due = enc_eval and pc.eval_due(cfg, step, plan)
        out = {f"eval/{k}": v for k, v in ev().items() if k in ("loss", "perplexity")} if due else {}
        log.record(step, out)  # evaluated before the step's checkpoint, as transformers: its trainer_state has it
        cp.save_if_due(plan, step, engine, env, log, export, vision.saved_tokenizer(tok))
        return out

    notes["forward_tokens"] = 0
    # train_pairs counts an epoch's steps (for a resume's skip) by whole global batches of what it is given
    counted = range(per_epoch * pc.global_batch(cfg, env.world_size))
    loss = _micro_batch_loss(cfg, env, neft, notes, summed_of)
    loader = train_batches(enc_train, collate, cfg, env)
    loader = batches(loader, engine, enc_train, tok, env, log) if batches is not None else loader
    step = pc.train_pairs(engine, loss, counted, [], tok.pad_token_id, cfg, env, log, total, {"eval/loss": "eval"},
                          after_step, start, loader=loader)
    if neft is not None:  # the saved (and the caller's) model carries no hook
        neft.remove()
    after = ev()
    if after:
        pc.check_eval_finite(after["loss"], "losses")
    results = _report(cfg, log, before, after, step, n_rows, notes, env, engine.name, t0)
    writer, state = export(engine.full_state_dict())  # collective
    pc.save_hf_folder(out_dir, writer, state, vision.saved_tokenizer(tok), {"eval_results.json": results}, env,
                      log_dir=log_dir, keep=plan.inside(out_dir))
    if after:
        log.metrics(step, {"eval/loss": after["loss"], "eval/perplexity": after["perplexity"],
                           "eval/loss_before": before["loss"]})
    log.print(f"saved model to {out_dir} ({results['seconds']:.1f}s)")
    barrier(env)
    shutdown()
    return results


def _micro_batch_loss(cfg: SFTConfig, env, neft, notes: dict, summed_of):
    """`common.train_pairs`' loss_fn: the micro-batch's summed loss over its step's trained tokens (all ranks')."""
    def loss(module, batch: SFTBatch, _global_pairs):  # dropout's draws are keyed by the micro-batch (train_pairs)
        if neft is not None:
            neft.arm(batch)  # its draws too
        notes["forward_tokens"] += batch.input_ids.numel()  # this rank's, padding included
        summed, sums, *means = summed_of(module, batch)
        # logged so that the step's mean over its micro-batches and ranks is the loss it optimises: the token mean
        # over all of the step's trained tokens (not a mean of micro-batch means)
        shares = {k: float(v) / batch.global_tokens * cfg.gradient_accumulation_steps * env.world_size
                  for k, v in {"loss": summed.detach(), **sums}.items()}
        return summed / batch.global_tokens, {**shares, **(means[0] if means else {})}

    return loss


def _tokenizer(cfg: SFTConfig, log):
    """(the model's folder, its tokenizer: TRL's eos_token set, the chat template's variables bound)."""
    from alignrl.models.loader import load_tokenizer, resolve_model_path
    folder = resolve_model_path(cfg.model_path, log.print, "model_path")
    tok = load_tokenizer(folder, chat=False, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    _set_eos(tok, cfg.eos_token)
    pc.bind_template_variables(tok, cfg, log)
    return folder, tok


def _set_eos(tok, token: str) -> None:
    """TRL's --eos_token: the tokenizer's eos becomes `token` (rows are closed by it, and the saved tokenizer keeps
    it); a token the vocabulary lacks is one line."""
    if not token:
        return
    from alignrl.config import ConfigError

    got = tok.convert_tokens_to_ids(token)
    if got is None or (got == tok.unk_token_id and token != tok.unk_token):
        raise ConfigError(f"eos_token={token!r} is not a token of the model's tokenizer; give one of its tokens "
                          f"(its own eos is {tok.eos_token!r}), or leave eos_token empty")
    tok.eos_token = token


def _layout(cfg: SFTConfig, pad_id: int, model, log):
    """(the micro-batches' collate function, NEFTune's hook or None), said once; packing is refused in one line
    for a model whose attention would let packed rows see each other (`sft_packing.check_packable`)."""
    if (cfg.packing or (eval_packs(cfg) and cfg.eval_files)) and cfg.packing_strategy != "wrapped":
        check_packable(model, cfg.max_length)
    if cfg.packing and cfg.packing_strategy == "micro_batch":
        log.print(f"packing: each micro-batch's rows in sequences of at most max_length={cfg.max_length} tokens, "
                  "position ids restarting at each row, no padding")
    if cfg.neftune_noise_alpha:
        log.print(f"NEFTune: noise alpha={cfg.neftune_noise_alpha} on the input embeddings in training")
    return collator(cfg, pad_id, model), NEFTune(model, cfg.neftune_noise_alpha) if cfg.neftune_noise_alpha else None


def _report(cfg: SFTConfig, log, before: dict | None, after: dict | None, step: int, n_train: int, notes: dict, env,
            strategy: str, t0: float) -> dict:
    """The held-out loss before -> after, printed, and the run's results (eval_results.json)."""
    if before and after:
        log.print(f"held-out loss {before['loss']:.4f} -> {after['loss']:.4f}, perplexity {before['perplexity']:.3f} "
                  f"-> {after['perplexity']:.3f} on {after['tokens']} tokens")
    return {"before": before, "after": after, "steps": step, "train_rows": n_train, **notes,
            "train_files": [str(f) for f in cfg.train_files], "eval_files": [str(f) for f in cfg.eval_files],
            "completion_only_loss": cfg.completion_only_loss, "assistant_only_loss": cfg.assistant_only_loss,
            "max_length": cfg.max_length, "world_size": env.world_size, "strategy": strategy,
            "use_lora": cfg.use_lora, "packing": cfg.packing,
            "packing_strategy": cfg.packing_strategy if cfg.packing or eval_packs(cfg) else None,
            "eval_packing": eval_packs(cfg),
            "neftune_noise_alpha": cfg.neftune_noise_alpha,
            "effective_batch": pc.global_batch(cfg, env.world_size),
            "seconds": round(time.time() - t0, 1), "model_path": cfg.model_path}
