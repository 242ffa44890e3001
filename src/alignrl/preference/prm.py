"""Process reward models (`alignrl train prm`), as OpenRLHF's `train_prm` trains them.

    alignrl train prm train_files=[data/steps.jsonl] eval_files=[data/steps_test.jsonl] --output_dir models/prm

The model is a causal LM trained through a TrainEngine (one process, DDP, FSDP2 or DeepSpeed; with `use_lora`, its
LoRA adapters alone) on the rows of `data.prm_rows`: solutions whose steps each end in a placeholder token, a label
per step. At each placeholder the logits of the reward tokens alone are trained toward the step's label
(`core.prm`), so the saved model is an ordinary causal LM whose next-token distribution after a placeholder, over
the reward tokens, scores that step (`score_steps`). With `reward_tokens=[]` (OpenRLHF's --reward_tokens unset, what a
line in its spelling without it trains) the cross-entropy is over the whole vocabulary instead, each label the text of
one token; the data's distinct labels are then the tokens a scorer reads, the positive one first where it can be told
(`data.prm_rows.positive_first`; else the start says so and `load_scorer` asks for it).

The loss of an optimizer step is the mean over all of its counted steps, over micro-batches and ranks (every step
weighs the same, however the steps fall into rows and micro-batches). Held-out rows are measured before and after
training (and every `eval_steps`): the step-mean loss and the step accuracy (the arg-max reward token is the label's),
over every step even with `train_on_last_step_only`; written to `<output_dir>/eval_results.json` beside the saved
HF folder, with `prm_tokens.json` naming the placeholder and reward tokens and the loss. `save_steps` writes resumable
checkpoints and `resume_from` goes on from one. Left out: packing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from alignrl.core.prm import label_token_ids, positive_probs, reduced, step_terms, vocab_step_terms
from alignrl.data.blend import read_files
from alignrl.data.prm_rows import (EncodedPRM, PRMBatch, PRMKeys, PRMRow, collate_rows, counted_steps,
                                   distinct_labels, encode_rows, encode_text, load_rows, over_label_tokens,
                                   positive_first, single_token)
from alignrl.preference import adapters
from alignrl.preference import checkpoint_plan as cp
from alignrl.preference import common as pc
from alignrl.preference.prm_cli import PRMConfig

TOKENS_FILE = "prm_tokens.json"  # in the saved folder: what a scorer needs besides the model
CONSOLE = {"acc": "acc"}


def _load(files: list[str], cfg: PRMConfig, limit: int, key: str, probs=()) -> list[PRMRow]:
    """The rows of the first `limit` lines of all `files` together (OpenRLHF's --max_samples; 0: all), concatenated
    or blended by `probs` (`read_files`)."""
    keys = PRMKeys(cfg.input_key, cfg.prompt_key, cfg.completions_key, cfg.label_key)

    def read(f, n: int | None) -> list[PRMRow]:
        return load_rows(str(f), keys, cfg.placeholder_token, [str(t) for t in cfg.reward_tokens],
                         cfg.step_separator, n, key)

    return [row for _, row in read_files(files, read, limit or None, probs, cfg.seed, key)]


def token_ids(tokenizer, placeholder: str, reward_tokens: list[str], what: str = "reward_tokens' token"
              ) -> tuple[int, list[int]]:
    """(the placeholder's id, the reward tokens' ids): each must be one token of `tokenizer`, all different; `what`
    names a reward token in the error."""
    pid = single_token(tokenizer, placeholder, "placeholder_token")
    rids = [single_token(tokenizer, str(t), what) for t in reward_tokens]
    if len(set(rids + [pid])) != len(rids) + 1:
        from alignrl.data.loaders import DataError

        raise DataError(f"placeholder_token {placeholder!r} and reward_tokens {reward_tokens} are not all different "
                        "tokens in this tokenizer; pick others")
    return pid, rids


def label_tokens(tokenizer, cfg: PRMConfig, rows: list[PRMRow]) -> tuple[list[str], str | None]:
    """(the tokens the targets are over, the first the positive label, which a scorer reads; the positive label, or
    None where it cannot be told): `reward_tokens`, or without them the rows' distinct labels (`positive_first`; the
    other side of a known pair only where it is one token here)."""
    if cfg.reward_tokens:
        return [str(t) for t in cfg.reward_tokens], str(cfg.reward_tokens[0])
    seen = distinct_labels(rows)
    tokens, positive = positive_first(seen)
    added = [t for t in tokens if t not in seen]  # a pair's other side, for the scorer: only as one token of its own
    if any(t == cfg.placeholder_token or len(tokenizer.encode(t, add_special_tokens=False)) != 1 for t in added):
        return seen, None
    return tokens, positive


def step_counts(encoded: list[EncodedPRM], cfg: PRMConfig, world: int, epoch: int) -> list[float]:
    """The counted steps of each optimizer step of `epoch`, over every micro-batch of every rank."""
    accum = cfg.gradient_accumulation_steps
    counts: list[float] = []
    for rank in range(world):
        for i, batch in enumerate(pc.micro_batches(len(encoded), cfg, world, rank, epoch)):
            if i // accum == len(counts):
                counts.append(0.0)
            counts[i // accum] += sum(len(counted_steps(encoded[j], cfg.train_on_last_step_only)) for j in batch)
    return counts


def train_batches(encoded: list[EncodedPRM], pad_id: int, n_tokens: int, cfg: PRMConfig, env):
    """`loader(epoch)` for `common.train_pairs`: this rank's micro-batches, each knowing its step's global count."""
    from torch.utils.data import DataLoader

    def loader(epoch: int):
        counts = step_counts(encoded, cfg, env.world_size, epoch)
        mine = pc.micro_batches(len(encoded), cfg, env.world_size, env.rank, epoch)
        items = [(batch, counts[i // cfg.gradient_accumulation_steps]) for i, batch in enumerate(mine)]
        # a generator of its own: the loader's seed draw leaves the global random state (dropout's) alone
        return DataLoader(items, batch_size=None, num_workers=cfg.num_workers, pin_memory=env.device.type == "cuda",
                          generator=torch.Generator().manual_seed(cfg.seed),
                          collate_fn=lambda item: collate_rows([encoded[j] for j in item[0]], pad_id, n_tokens,
                                                               item[1], cfg.train_on_last_step_only))

    return loader


def eval_batches(encoded: list[EncodedPRM], pad_id: int, n_tokens: int, batch_size: int, env) -> list[PRMBatch]:
    """This rank's share of the held-out rows (rank::world), every step counted, padded with uncounted copies so
    that every rank runs the same number of forwards (sharded engines need all ranks in each one)."""
    if not encoded:
        return []
    mine = encoded[env.rank::env.world_size]
    per_rank = -(-len(encoded) // env.world_size)
    counted = [True] * len(mine) + [False] * (per_rank - len(mine))
    mine = mine + [encoded[0]] * (per_rank - len(mine))
    return [collate_rows(mine[i:i + batch_size], pad_id, n_tokens, counted=counted[i:i + batch_size])
            for i in range(0, len(mine), batch_size)]


def logits_of(model, batch: PRMBatch, cfg: PRMConfig, device: torch.device) -> torch.Tensor:
    with pc.autocast(cfg, device):
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long(), use_cache=False).logits


def batch_terms(logits: torch.Tensor, batch: PRMBatch, reward_ids: list[int], cfg: PRMConfig
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy, correct) of each counted step: over the reward tokens, or with reward_tokens=[] over the whole
    vocabulary against the label token's id."""
    if cfg.reward_tokens:
        return step_terms(logits, batch.step_mask, batch.targets, reward_ids)
    return vocab_step_terms(logits, batch.step_mask, label_token_ids(batch.targets, reward_ids))


@torch.no_grad()
def evaluate(model, batches: list[PRMBatch], reward_ids: list[int], cfg: PRMConfig, env) -> dict:
    """The held-out step-mean loss and step accuracy over all ranks' shares."""
    from alignrl.runtime.env import all_reduce_sum

    was = model.training
    model.eval()
    sums = [0.0, 0.0, 0.0]
    for batch in batches:
        batch = batch.to(env.device)
        ce, correct = batch_terms(logits_of(model, batch, cfg, env.device), batch, reward_ids, cfg)
        sums = [sums[0] + float(ce.sum()), sums[1] + float(correct.sum()), sums[2] + ce.numel()]
    model.train(was)
    total, right, steps = all_reduce_sum(env, sums)
    return {"loss": total / max(steps, 1.0), "step_accuracy": right / max(steps, 1.0), "steps": int(steps)}


def _loss_fn(cfg: PRMConfig, env, reward_ids: list[int]):
    def loss(module, batch: PRMBatch, _global_rows: float):
        logits = logits_of(module, batch, cfg, env.device)
        value, m = reduced(logits, *batch_terms(logits, batch, reward_ids, cfg), batch.total_steps)
        # logged as the share that makes the mean over micro-batches and ranks the step's own step-mean loss
        share = float(value.detach()) * cfg.gradient_accumulation_steps * env.world_size
        return value, {"loss": share, "acc_sum": m["acc_sum"], "acc_count": m["acc_count"]}

    return loss


@torch.no_grad()
def score_steps(model, tokenizer, texts: list[str], placeholder_token: str, reward_tokens: list[str]
                ) -> list[list[float]]:
    """P(the first reward token) at each placeholder of each text (rows in the placeholder form), one text per
    forward: what a trained PRM says of each step, in order. A text is tokenised as training tokenised its rows
    (`data.prm_rows.encode_text`): whole, or piece by piece where its placeholder merged into another token."""
    pid, rids = token_ids(tokenizer, placeholder_token, reward_tokens)
    device = next(model.parameters()).device
    out = []
    for text in texts:
        ids, steps, _ = encode_text(tokenizer, text, text.split(placeholder_token), pid)
        if not steps:
            out.append([])
            continue
        logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits
        mask = torch.zeros((1, len(ids)), dtype=torch.bool, device=device)
        mask[0, steps] = True
        out.append(positive_probs(logits, mask, rids).tolist())
    return out


def read_tokens(folder: str | Path, reward_tokens: list[str] | None = None) -> tuple[str, list[str]]:
    """(placeholder token, reward tokens: `reward_tokens` if given, else the folder's) of a folder `alignrl train
    prm` saved; a folder trained on the whole vocabulary whose labels did not tell the positive one needs them."""
    from alignrl.config import ConfigError

    path = Path(folder) / TOKENS_FILE
    spec = json.loads(path.read_text())
    if isinstance(reward_tokens, str):
        raise ConfigError(f"reward_tokens={reward_tokens!r}: give a list of the label tokens, the positive first")
    trained = [str(t) for t in spec["reward_tokens"]]
    if reward_tokens and spec.get("loss") == "whole_vocabulary" and not set(map(str, reward_tokens)) <= set(trained):
        raise ConfigError(f"{path}: reward_tokens={list(reward_tokens)} names tokens this model was not trained to put "
                          f"after a step; name its labels {' '.join(trained)}, the positive first")
    if reward_tokens:
        return spec["placeholder_token"], [str(t) for t in reward_tokens]
    if "positive_label" in spec and spec["positive_label"] is None:
        raise ConfigError(f"{path}: the labels {' '.join(spec['reward_tokens'])} do not tell which is the positive "
                          "one; name them for scoring, positive first: load_scorer(folder, reward_tokens=[...])")
    return spec["placeholder_token"], list(spec["reward_tokens"])


def load_scorer(folder: str | Path, reward_tokens: list[str] | None = None):
    """(the model in eval mode, its tokenizer, the placeholder token, the reward tokens) of a folder that
    `alignrl train prm` saved: what `score_steps` takes. `reward_tokens` (the positive first) replaces the folder's:
    needed where its labels did not tell the positive one."""
    from alignrl.models.loader import load_causal_lm, load_tokenizer

    placeholder, reward_tokens = read_tokens(folder, reward_tokens)
    model = load_causal_lm(Path(folder), "float32", "model_path").eval()
    return model, load_tokenizer(Path(folder), chat=False), placeholder, reward_tokens


def _say_loss(cfg: PRMConfig, tokens: list[str], rids: list[int], positive: str | None, log) -> None:
    """The one line at start naming the loss that runs (and, without reward tokens, a second one where the labels do
    not tell the positive one)."""
    listed = f"{' '.join(tokens)} (ids {rids})"
    if cfg.reward_tokens:
        log.print(f"loss: cross-entropy over the reward tokens {listed} alone at each placeholder")
        return
    log.print(f"loss: cross-entropy over the whole vocabulary at each placeholder (reward_tokens=[], OpenRLHF's "
              f"without --reward_tokens), each step's label token its target; labels {listed}")
    if positive is None:
        log.print(f"note: the labels {' '.join(tokens)} do not tell which is the positive one: name it for scoring, "
                  "load_scorer(folder, reward_tokens=[POSITIVE, ...])")


def _encode(tok, cfg: PRMConfig, train_rows: list[PRMRow], eval_rows: list[PRMRow], log):
    tokens, positive = label_tokens(tok, cfg, train_rows + eval_rows)
    train_rows, eval_rows = over_label_tokens(train_rows, tokens), over_label_tokens(eval_rows, tokens)
    pid, rids = token_ids(tok, cfg.placeholder_token, tokens,
                          "reward_tokens' token" if cfg.reward_tokens else "reward_tokens=[]: the label")
    enc_train, notes = encode_rows(tok, train_rows, pid, cfg.max_length)
    enc_eval, eval_notes = encode_rows(tok, eval_rows, pid, cfg.max_length)
    labelled = sum(len(e.steps) for e in enc_train)
    trained = sum(len(counted_steps(e, cfg.train_on_last_step_only)) for e in enc_train)
    counts = (f"{labelled} labelled steps, {trained} trained: train_on_last_step_only" if trained != labelled
              else f"{trained} steps")
    log.print(f"PRM: {len(enc_train)} train rows ({counts}) from {', '.join(map(str, cfg.train_files))}, "
              f"{len(enc_eval)} held-out; placeholder {cfg.placeholder_token!r} (id {pid}); "
              f"max_length={cfg.max_length} cut "
              f"{notes['truncated_rows']} rows, dropping {notes['dropped_labels']} labels "
              f"({notes['dropped_rows']} rows with no whole step left)")
    _say_loss(cfg, tokens, rids, positive, log)
    pieces = notes["piece_rows"] + eval_notes["piece_rows"]
    if pieces:  # the model sees those rows' text tokenised otherwise than a reader tokenising it whole would
        log.print(f"note: {notes['piece_rows']} train and {eval_notes['piece_rows']} held-out rows tokenised piece "
                  f"by piece: their whole text did not hold one {cfg.placeholder_token!r} token per label (it merged "
                  "with a neighbouring text into another token)")
    if eval_notes["dropped_labels"]:
        log.print(f"held-out rows: max_length cut {eval_notes['truncated_rows']} rows, dropping "
                  f"{eval_notes['dropped_labels']} labels")
    return enc_train, enc_eval, pid, rids, {**notes, "train_steps": trained, "train_labelled_steps": labelled,
                                            "eval_dropped_labels": eval_notes["dropped_labels"],
                                            "eval_piece_rows": eval_notes["piece_rows"], "reward_tokens": tokens,
                                            "positive_label": positive}


def _fmt(e: dict) -> str:
    return f"step loss {e['loss']:.4f}, step accuracy {e['step_accuracy']:.3f} over {e['steps']} steps"


def train_prm(cfg: PRMConfig, dry_run_world: int | None = None) -> dict:
    from alignrl.models.loader import load_tokenizer, resolve_model_path
    from alignrl.runtime.env import barrier, init_distributed, shutdown

    train_rows = _load(list(cfg.train_files), cfg, cfg.max_train_pairs, "train_files", cfg.train_files_probs)
    eval_rows = _load(list(cfg.eval_files), cfg, cfg.max_eval_pairs, "eval_files")
    what = ", ".join(map(str, cfg.train_files))
    if dry_run_world:
        pc.check_enough(len(train_rows), cfg, dry_run_world, what)
        return {}
    out_dir, log_dir = pc.run_folders(cfg, "models/prm", "logs/training/prm")
    t0 = time.time()
    env = init_distributed()
    log = pc.RankZeroLog(env, log_dir, cfg.report_to)
    folder = resolve_model_path(cfg.model_path, log.print, "model_path")
    tok = load_tokenizer(folder, chat=False)
    enc_train, enc_eval, pid, rids, notes = _encode(tok, cfg, train_rows, eval_rows, log)
    pc.check_enough(len(enc_train), cfg, env.world_size, what)
    policy, model, spec = pc.trainable_causal_lm(cfg, folder, log)
    total = pc.total_steps(len(enc_train), cfg, env.world_size)
    engine = pc.build_engine_for(cfg, model, env, total)
    log.print(f"{pc.describe_batch(cfg, env.world_size).replace('pairs', 'rows')}; {total} optimizer steps, "
              f"strategy {engine.name}, world size {env.world_size}, bf16 {pc.use_bf16(cfg)}")
    evals = eval_batches(enc_eval, tok.pad_token_id, len(rids), cfg.eval_batch_size, env)
    ev = (lambda: evaluate(engine.model, evals, rids, cfg, env)) if enc_eval else (lambda: None)  # noqa: E731
    before = ev()
    if before:
        log.print("held-out before training: " + _fmt(before))
    plan = cp.plan_for(cfg, out_dir, total, pc.steps_per_epoch(len(enc_train), cfg, env.world_size))
    loss_type = "reward_tokens" if cfg.reward_tokens else "whole_vocabulary"
    setting = {"loss": loss_type, "label_tokens": notes["reward_tokens"]}  # a resume must train the same loss
    # checkpoints from before the whole-vocabulary loss trained over the reward tokens
    start = cp.resumed_step(cfg, plan, engine, "prm", log, env, setting, unrecorded={"loss": "reward_tokens"})
    export = adapters.exporter(policy, model, spec, cfg.lora_export)
    tokens = {"placeholder_token": cfg.placeholder_token, "reward_tokens": notes.pop("reward_tokens"),
              "placeholder_id": pid, "reward_ids": rids, "step_separator": cfg.step_separator,
              "loss": loss_type, "positive_label": notes.pop("positive_label")}
    tokens["score"] = ("softmax over the reward tokens' logits at each placeholder; " + (
        "the first is the positive label" if tokens["positive_label"] is not None else
        "which is the positive label is not known: name it (load_scorer's reward_tokens)"))

    def after_step(step: int) -> dict[str, float]:  # collective: every rank reaches the same steps
        due = enc_eval and pc.eval_due(cfg, step, plan)
        out = {f"eval/{k}": v for k, v in ev().items() if k in ("loss", "step_accuracy")} if due else {}
        log.record(step, out)  # evaluated before the step's checkpoint, as transformers: its trainer_state has it
        cp.save_if_due(plan, step, engine, env, log, export, tok, {TOKENS_FILE: tokens}, setting=setting)
        return out

    step = pc.train_pairs(engine, _loss_fn(cfg, env, rids), enc_train, [], tok.pad_token_id, cfg, env, log, total,
                          CONSOLE, after_step, start, loader=train_batches(enc_train, tok.pad_token_id, len(rids),
                                                                           cfg, env))
    after = ev()
    if after:
        pc.check_eval_finite(after["loss"], "step losses")
        log.print("held-out after training:  " + _fmt(after))
    results = {"before": before, "after": after, "steps": step, "train_rows": len(enc_train), **notes,
               **{k: v for k, v in tokens.items() if k != "loss"}, "loss_type": loss_type,  # beside the float losses
               "train_on_last_step_only": cfg.train_on_last_step_only,
               "train_files": [str(f) for f in cfg.train_files], "eval_files": [str(f) for f in cfg.eval_files],
               "max_length": cfg.max_length, "world_size": env.world_size, "strategy": engine.name,
               "use_lora": cfg.use_lora, "effective_batch": pc.global_batch(cfg, env.world_size),
               "seconds": round(time.time() - t0, 1), "model_path": cfg.model_path}
    writer, state = export(engine.full_state_dict())  # collective
    pc.save_hf_folder(out_dir, writer, state, tok, {"eval_results.json": results, TOKENS_FILE: tokens}, env,
                      log_dir=log_dir, keep=plan.inside(out_dir))
    if after:
        log.metrics(step, {"eval/loss": after["loss"], "eval/step_accuracy": after["step_accuracy"],
                           "eval/step_accuracy_before": before["step_accuracy"]})
    log.print(f"saved process reward model to {out_dir} ({results['seconds']:.1f}s)")
    barrier(env)
    shutdown()
    return results
