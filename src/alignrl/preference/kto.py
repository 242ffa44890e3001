"""KTO on unpaired feedback (`alignrl train kto`), as TRL's `KTOTrainer` and OpenRLHF's `train_kto` run it.

    alignrl train kto train_files=[data/feedback.jsonl] eval_files=[data/test.jsonl] --output_dir models/kto --nproc 2

The policy trains through a TrainEngine (one process, DDP, FSDP2 or DeepSpeed; with `use_lora`, its LoRA adapters
alone) on the rows of `data.kto_rows`: a prompt with one completion labelled desirable or not. The frozen reference
is a copy of the initial policy (or of `ref_model_path`) in eval mode; with LoRA it is the policy itself with its
adapters off. The policy scores a micro-batch's own completions and, for loss_type kto, its mismatched ones (row i's
prompt with row i + 1's completion), the mismatched ones in a forward without gradients (z0 is detached, as in TRL's
KTOTrainer); the reference scores both in one forward; the loss is `core.kto`'s.

The reference point z0 (the KL estimate) is, as in TRL and OpenRLHF, computed per micro-batch: the mean over that
micro-batch's mismatched pairs, averaged over ranks, then clamped at 0. So gradient accumulation gives the update of
one big batch exactly when both splits give the same z0 (on the first step, where the policy is the reference, z0
is 0 for any split; apo_zero_unpaired has no z0 and splits freely); otherwise each micro-batch weighs its rows
against its own, noisier, estimate.

Held-out rows are measured before and after training (and every `eval_steps`): the mean implicit reward
β·(log π - log π_ref) of their desirable and undesirable rows, the margin between the two, the KL estimate over the
whole held-out set (row i paired with row i + 1's completion) and the loss against it; written to
`<output_dir>/eval_results.json` beside the saved HF causal-LM folder. `save_steps` writes resumable checkpoints and
`resume_from` goes on from one (`preference.checkpoints`). Left out: precomputed reference log-probs, a moving
reference, encoder-decoder models.
"""

from __future__ import annotations

import time

import torch

from alignrl.core.kto import NEEDS_KL, kl_estimate, kto_loss, weight_balance
from alignrl.data.blend import read_files
from alignrl.data.kto_rows import (EncodedKTO, KTOBatch, KTOKeys, KTORow, collate_rows, encode_rows, load_rows,
                                    mismatched)
from alignrl.preference import adapters
from alignrl.preference import checkpoint_plan as cp
from alignrl.preference import common as pc
from alignrl.preference.cli import same_model
from alignrl.preference.kto_cli import KTOConfig
from alignrl.preference.pair_logps import pair_logps
from alignrl.preference.run_log import totals_per_count

CONSOLE = {"rewards/chosen": "chosen", "rewards/rejected": "rejected", "kl": "kl"}


def _load(files: list[str], keys: KTOKeys, limit: int, key: str, probs=(), seed: int = 42) -> list[KTORow]:
    """The rows of the first `limit` lines of all `files` together (OpenRLHF's --max_samples: of the blend, not of
    each file; a paired line gives two rows; 0: all), concatenated or blended by `probs` (`read_files`)."""
    def lines(f, n: int | None) -> list[list[KTORow]]:  # a line's rows share its location
        by_line: dict[str, list[KTORow]] = {}
        for row in load_rows(str(f), keys, n, key):
            by_line.setdefault(row.loc, []).append(row)
        return list(by_line.values())

    return [row for _, line in read_files(files, lines, limit or None, probs, seed, key) for row in line]


def logps(model, batch: KTOBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log π of each row's own completion (B,), of its mismatched one (B,) or None): one forward over both."""
    own, kl, _ = pair_logps(model, batch, "sum")
    return own.float(), (kl.float() if batch.has_kl else None)


def _half(batch: KTOBatch, rows: slice) -> KTOBatch:
    """Rows [0, B) (own completions) or [B, 2B) (mismatched ones) of a batch as a batch of their own, padding kept."""
    return KTOBatch(batch.prompt_ids[rows], batch.prompt_mask[rows], batch.response_ids[rows],
                    batch.response_mask[rows], batch.desirable, batch.index, batch.weight, batch.global_rows)


def policy_logps(model, batch: KTOBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`logps` for training: the own completions with gradients, the mismatched ones in a second forward without
    (as TRL's KTOTrainer). z0 is detached, so their activations would be kept for a backward that gives nothing."""
    if not batch.has_kl:
        return logps(model, batch)
    b = batch.n_pairs
    with torch.no_grad():  # first: the forward with gradients is then the last before the backward (DDP's hooks)
        kl, _, _ = pair_logps(model, _half(batch, slice(b, 2 * b)), "sum")
    own, _, _ = pair_logps(model, _half(batch, slice(0, b)), "sum")
    return own.float(), kl.float()


class Reference:
    """The frozen reference's log-probs of a batch: from a copy of the initial policy (or of ref_model_path), or from
    the policy itself with its LoRA adapters off (`use_adapters_off`)."""

    def __init__(self, cfg: KTOConfig, policy, env, lora: bool, log):
        from alignrl.models.loader import frozen_copy, load_causal_lm, resolve_model_path

        self.cfg, self.device, self.adapters_of, self.model = cfg, env.device, None, None
        if lora and same_model(cfg.ref_model_path, cfg.model_path):
            return  # the adapters come later (`use_adapters_off`): no second copy
        # copied before prepare_trainable changes the policy
        self.model = frozen_copy(policy if same_model(cfg.ref_model_path, cfg.model_path) else load_causal_lm(
            resolve_model_path(cfg.ref_model_path, log.print, "ref_model_path"), "float32", "ref_model_path"))
        self.model.to(env.device, torch.bfloat16 if pc.use_bf16(cfg) else torch.float32)

    def use_adapters_off(self, peft_model) -> None:
        self.adapters_of = peft_model

    @torch.no_grad()
    def __call__(self, batch: KTOBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        from alignrl.models.lora import adapters_off

        if self.adapters_of is not None:
            with adapters_off(self.adapters_of), pc.autocast(self.cfg, self.device):
                return logps(self.adapters_of, batch)
        with pc.autocast(self.cfg, self.device):
            return logps(self.model, batch)


def train_batches(encoded: list[EncodedKTO], pad_id: int, cfg: KTOConfig, env, tokenizer=None):
    """`loader(epoch)` for `common.train_pairs`: this rank's micro-batches, with their mismatched rows (`tokenizer`:
    rows of OpenRLHF's text join as text)."""
    from torch.utils.data import DataLoader

    with_kl = cfg.loss_type in NEEDS_KL

    def collate(batch: list[int]) -> KTOBatch:
        rows = [encoded[j] for j in batch]
        kl_p, kl_c = mismatched(rows, tokenizer) if with_kl else (None, None)
        return collate_rows(rows, pad_id, pc.global_batch(cfg, env.world_size), kl_c, max_length=cfg.max_length,
                            kl_prompts=kl_p)

    def loader(epoch: int):
        mine = pc.micro_batches(len(encoded), cfg, env.world_size, env.rank, epoch)
        # a generator of its own: the loader's seed draw leaves the global random state (dropout's) alone
        return DataLoader(mine, batch_size=None, num_workers=cfg.num_workers, pin_memory=env.device.type == "cuda",
                          generator=torch.Generator().manual_seed(cfg.seed), collate_fn=collate)

    return loader


def eval_batches(encoded: list[EncodedKTO], pad_id: int, cfg: KTOConfig, env, tokenizer=None) -> list[KTOBatch]:
    """This rank's share of the held-out rows (rank::world), each with row i + 1's completion of the whole held-out
    set as its mismatched one (the same pairs whatever the ranks), padded with weight-0 copies so that every rank runs
    the same number of forwards (sharded engines need all ranks in each one)."""
    kl_p, kl_c = mismatched(encoded, tokenizer)
    mine = list(range(len(encoded)))[env.rank::env.world_size]
    per_rank = -(-len(encoded) // env.world_size)
    weights = [1.0] * len(mine) + [0.0] * (per_rank - len(mine))
    mine = mine + [0] * (per_rank - len(mine))
    size = cfg.eval_batch_size
    return [collate_rows([encoded[j] for j in mine[i:i + size]], pad_id, 0.0, [kl_c[j] for j in mine[i:i + size]],
                         weights[i:i + size], cfg.max_length, [kl_p[j] for j in mine[i:i + size]])
            for i in range(0, len(mine), size)]


@torch.no_grad()
def evaluate(model, ref: Reference, batches: list[KTOBatch], encoded: list[EncodedKTO], cfg: KTOConfig, env) -> dict:
    """Held-out metrics over all ranks: the mean implicit reward of the desirable and the undesirable rows, their
    margin, how often a row lies on its label's side of the loss's reference point (kto: z0; apo_zero_unpaired: 0;
    ties half), the KL estimate z0 over the whole set and the loss against it."""
    from alignrl.preference.dpo import per_pair_table

    was = model.training
    model.eval()

    def rows(batch: KTOBatch) -> torch.Tensor:
        with pc.autocast(cfg, env.device):
            own, kl = logps(model, batch)
        ref_own, ref_kl = ref(batch)
        return torch.stack([own - ref_own, kl - ref_kl], 1)

    table = per_pair_table(rows, batches, len(encoded), 2, env)  # (N, 2): logratio, mismatched logratio
    model.train(was)
    good = torch.tensor([e.desirable for e in encoded], dtype=torch.bool)
    logratio, z0 = table[:, 0].float(), kl_estimate(table[:, 1], torch.zeros(len(encoded)))
    _, m = kto_loss(logratio, torch.zeros_like(logratio), good, cfg.beta, z0, cfg.desirable_weight,
                    cfg.undesirable_weight, loss_type=cfg.loss_type)
    m = totals_per_count(m)
    chosen, rejected = m.get("rewards/chosen", 0.0), m.get("rewards/rejected", 0.0)  # 0 for a kind the set lacks
    point = float(z0.clamp(min=0.0)) if cfg.loss_type in NEEDS_KL else 0.0  # what the loss measures rewards from
    above, tie = (logratio > point).float(), (logratio == point).float()
    agree = torch.where(good, above, 1.0 - above - tie) + 0.5 * tie
    return {"reward_desirable": chosen, "reward_undesirable": rejected,
            "reward_margin": chosen - rejected, "reward_accuracy": float(agree.mean()),
            "kl": point, "loss": m["kto/loss"], "rows": len(encoded), "desirable_rows": int(good.sum())}


def _loss_fn(cfg: KTOConfig, env, ref: Reference):
    from alignrl.runtime.env import all_reduce_sum

    def loss(module, batch: KTOBatch, global_rows: float):
        with pc.autocast(cfg, env.device):
            own, kl = policy_logps(module, batch)
        ref_own, ref_kl = ref(batch)
        z0 = 0.0
        if kl is not None:  # a collective: every rank runs the same micro-batches
            z0 = all_reduce_sum(env, [float(kl_estimate(kl, ref_kl))])[0] / env.world_size
        value, metrics = kto_loss(own, ref_own, batch.desirable, cfg.beta, z0, cfg.desirable_weight,
                                  cfg.undesirable_weight, global_rows, cfg.loss_type)
        return value, {**metrics, "loss": metrics["kto/loss"]}

    return loss


def _policy_and_reference(cfg: KTOConfig, folder, env, log):
    """(the policy, the module trained: the policy or its peft wrapper under LoRA, the LoRA spec, the reference)."""
    policy = pc.load_policy(cfg, folder, env.device, log)
    spec = adapters.spec_of(cfg)
    ref = Reference(cfg, policy, env, spec is not None, log)
    pc.prepare_trainable(policy, cfg)
    if spec is None:
        return policy, policy, spec, ref
    model = adapters.attach(policy, spec, "CAUSAL_LM", cfg.seed)
    if ref.model is None:
        ref.use_adapters_off(model)
    which = "the policy with its adapters off" if ref.model is None else cfg.ref_model_path
    log.print(f"LoRA r={spec.rank} alpha={spec.alpha} on {spec.target_modules}: {adapters.count(model)}; the reference "
              f"is {which}")
    return policy, model, spec, ref


def _encode(tok, cfg: KTOConfig, train_rows: list[KTORow], eval_rows: list[KTORow], log):
    chat = pc.string_rows_templated(cfg, tok)
    enc_train, cut = encode_rows(tok, train_rows, chat, cfg.max_length, cfg.input_template)
    enc_eval, _ = encode_rows(tok, eval_rows, chat, cfg.max_length, cfg.input_template)
    good = sum(e.desirable for e in enc_train)
    log.print(f"KTO ({cfg.loss_type}, beta {cfg.beta}): {len(enc_train)} train rows from "
              f"{', '.join(map(str, cfg.train_files))} ({good} desirable, {len(enc_train) - good} undesirable), "
              f"{len(enc_eval)} held-out; string rows through the chat template: {chat}; {cut} rows longer than "
              f"max_length={cfg.max_length} cut")
    balance = weight_balance(good, len(enc_train) - good, cfg.desirable_weight, cfg.undesirable_weight)
    if balance is not None and not 1.0 <= balance <= 4 / 3:  # the KTO paper's advice, which TRL warns about too
        n_bad = len(enc_train) - good
        low, high = n_bad * cfg.undesirable_weight / good, 4 / 3 * n_bad * cfg.undesirable_weight / good
        log.print(f"warning: desirable rows × desirable_weight / (undesirable rows × undesirable_weight) = "
                  f"{balance:.3g}, outside the recommended [1, 4/3]; e.g. desirable_weight in [{low:.3g}, {high:.3g}]")
    return enc_train, enc_eval, {"truncated_rows": cut, "chat_template": chat, "desirable_rows": good,
                                 "undesirable_rows": len(enc_train) - good}


def _fmt(e: dict) -> str:
    return (f"reward desirable {e['reward_desirable']:+.4f}, undesirable {e['reward_undesirable']:+.4f}, margin "
            f"{e['reward_margin']:+.4f}, accuracy {e['reward_accuracy']:.3f}, kl {e['kl']:.4f}")


def train_kto(cfg: KTOConfig, dry_run_world: int | None = None) -> dict:
    from alignrl.models.loader import load_tokenizer, resolve_model_path
    from alignrl.runtime.env import barrier, init_distributed, shutdown

    keys = KTOKeys(cfg.prompt_key, cfg.completion_key, cfg.label_key, cfg.chosen_key, cfg.rejected_key)
    train_rows = _load(list(cfg.train_files), keys, cfg.max_train_pairs, "train_files", cfg.train_files_probs,
                       cfg.seed)
    eval_rows = _load(list(cfg.eval_files), keys, cfg.max_eval_pairs, "eval_files")
    if dry_run_world:
        pc.check_enough(len(train_rows), cfg, dry_run_world, ", ".join(map(str, cfg.train_files)))
        return {}
    out_dir, log_dir = pc.run_folders(cfg, "models/kto", "logs/training/kto")
    t0 = time.time()
    env = init_distributed()
    pc.check_enough(len(train_rows), cfg, env.world_size, ", ".join(map(str, cfg.train_files)))
    log = pc.RankZeroLog(env, log_dir, cfg.report_to)
    folder = resolve_model_path(cfg.model_path, log.print, "model_path")
    tok = load_tokenizer(folder, chat=False)
    pc.bind_template_variables(tok, cfg, log)
    enc_train, enc_eval, notes = _encode(tok, cfg, train_rows, eval_rows, log)
    policy, model, spec, ref = _policy_and_reference(cfg, folder, env, log)
    total = pc.total_steps(len(enc_train), cfg, env.world_size)
    engine = pc.build_engine_for(cfg, model, env, total)
    log.print(f"{pc.describe_batch(cfg, env.world_size).replace('pairs', 'rows')}; {total} optimizer steps, "
              f"strategy {engine.name}, world size {env.world_size}, bf16 {pc.use_bf16(cfg)}")
    evals = eval_batches(enc_eval, tok.pad_token_id, cfg, env, tok)
    ev = (lambda: evaluate(engine.model, ref, evals, enc_eval, cfg, env)) if enc_eval else (lambda: None)  # noqa: E731
    before = ev()
    if before:
        log.print("held-out before training: " + _fmt(before))
    plan = cp.plan_for(cfg, out_dir, total, pc.steps_per_epoch(len(enc_train), cfg, env.world_size))
    start = cp.resumed_step(cfg, plan, engine, "kto", log, env)

    export = adapters.exporter(policy, model, spec, cfg.lora_export)
    def after_step(step: int) -> dict[str, float]:  # collective: every rank reaches the same steps
        due = enc_eval and pc.eval_due(cfg, step, plan)
        out = {f"eval/{k}": v for k, v in ev().items() if k in ("reward_margin", "kl", "loss")} if due else {}
        log.record(step, out)  # evaluated before the step's checkpoint, as transformers: its trainer_state has it
        cp.save_if_due(plan, step, engine, env, log, export, tok)
        return out

    step = pc.train_pairs(engine, _loss_fn(cfg, env, ref), enc_train, [], tok.pad_token_id, cfg, env, log, total,
                          CONSOLE, after_step, start, loader=train_batches(enc_train, tok.pad_token_id, cfg, env, tok))
    after = ev()
    if after:
        pc.check_eval_finite(after["reward_margin"], "log-probabilities")
        log.print("held-out after training:  " + _fmt(after))
    results = {"loss_type": cfg.loss_type, "beta": cfg.beta, "desirable_weight": cfg.desirable_weight,
               "undesirable_weight": cfg.undesirable_weight, "before": before, "after": after, "steps": step,
               "train_rows": len(enc_train), **notes, "train_files": [str(f) for f in cfg.train_files],
               "eval_files": [str(f) for f in cfg.eval_files], "max_length": cfg.max_length,
               "world_size": env.world_size, "strategy": engine.name, "use_lora": cfg.use_lora,
               "effective_batch": pc.global_batch(cfg, env.world_size), "seconds": round(time.time() - t0, 1),
               "model_path": cfg.model_path}
    writer, state = export(engine.full_state_dict())  # collective
    pc.save_hf_folder(out_dir, writer, state, tok, {"eval_results.json": results}, env, log_dir=log_dir,
                      keep=plan.inside(out_dir))
    if after:
        log.metrics(step, {"eval/reward_margin": after["reward_margin"], "eval/kl": after["kl"],
                           "eval/reward_margin_before": before["reward_margin"]})
    log.print(f"saved policy to {out_dir} ({results['seconds']:.1f}s)")
    barrier(env)
    shutdown()
    return results
