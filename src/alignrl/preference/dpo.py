"""DPO-family training (`alignrl train dpo`, training/train_safe_mm_dpo.py): Safe-MM-DPO by default.

    torchrun --nproc_per_node=2 -m src.training.train_safe_mm_dpo --config configs/dpo_config.yaml \\
        --output_dir models/aligned --logging_dir logs/training/safe_mm_dpo
    alignrl train dpo --config configs/dpo_config.yaml loss_type=sigmoid --nproc 2

The policy trains through a TrainEngine (one process, DDP, FSDP2 or DeepSpeed; with `use_lora`, its LoRA adapters
alone). The frozen reference is a copy of the initial policy (or of `ref_model_path`) on every rank in eval mode;
with LoRA it is the policy itself with its adapters off (no second copy); with `precompute_ref_log_probs` its
log-probs are computed once up front and the copy is freed. `loss_type` picks a `core.preference` loss:

* safe_mm_dpo (default; `alignrl.core.safe_mm_dpo`): a helpfulness reward model and a harmlessness judge (both
  trained by `alignrl train rm`) score both responses of every pair once before training; each pair gets two DPO
  losses with MM-DPO's margin-scaled β, mixed by the Safe RLHF multiplier λ, which moves after every optimizer step
  with the policy's expected cost (`preference.safe_mm`). λ is saved beside the policy (`safe_mm_dpo_state.json`)
  and a run whose model_path holds that file goes on from its λ.
* safe_odpo (also `safe`, its older name): the pair is ordered by the fixed-λ utility u = r - λ·c and trained with
  the ODPO loss -log σ(β·h - Δ), Δ = α·log(1 + |u_w - u_l|) (Amini et al. 2024).
* sigmoid (DPO; conservative DPO with label_smoothing, also named cdpo), ipo (on summed log-probs, OpenRLHF's;
  ipo_token_mean: TRL's, on the token means of policy and reference), hinge (SLiC), and TRL's robust,
  exo_pair, nca_pair, sppo_hard, aot, aot_pair, apo_zero, apo_down, discopop and bco_pair (its running reward mean
  δ shared by the ranks and checkpointed: `preference.dpo_mix`).
* a list, e.g. [sigmoid,bco_pair,sft] with loss_weights: the weighted sum of its losses (TRL's MPO; `dpo_mix`).
* simpo, cpo, orpo (TRL's CPO and ORPO trainers): the policy's log-probs alone (simpo and orpo their token means); no
  reference model is loaded.

`kl_coeff > 0` adds kl_coeff·KL(π‖π_ref) over the chosen responses (exact over the vocabulary) to any of them, and
`nll_loss_coef > 0` the chosen responses' NLL (RPO);
`logp_reduction` picks summed response log-probs (DPO's) or the whole sequence's token mean (`preference.pair_logps`).
TRL's reference_free (reference log-probs of 0, no model loaded), f_divergence_type, ld_alpha (LD-DPO) and
use_weighting (WPO) change what the losses read (`core.dpo_options`, `preference.pair_logps`, `dpo_mix.trl_keywords`).

Held-out reward accuracy (β-scaled implicit rewards, chosen > rejected, ties half) and margins are measured before
and after training (and every `eval_steps`), per eval file, and written to `<output_dir>/eval_results.json` beside
the saved HF causal-LM folder. `save_steps` writes resumable checkpoints (weights, optimizer, λ) and `resume_from`
goes on from one (`preference.checkpoints`). `sync_ref_model` (TR-DPO) moves the reference copy toward the policy
every `ref_model_sync_steps` optimizer steps (`preference.ref_sync`). Left out: online DPO.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from alignrl.preference import adapters
from alignrl.preference import checkpoint_plan as cp
from alignrl.preference import checkpoints as ckpt
from alignrl.preference import common as pc
from alignrl.preference.cli import same_model
from alignrl.preference.configs import LENGTH_NORMALISED, REFERENCE_FREE, SAFETY_LOSSES, DPOConfig
from alignrl.preference.dpo_mix import BcoDelta, mixed_loss, trl_keywords, uses_bco
from alignrl.preference.pair_logps import chosen_nll, pair_logps, policy_logps, response_kl, token_means
from alignrl.preference.ref_sync import ReferenceSync
from alignrl.preference.rm import check_scorer_kind, score_info
from alignrl.preference.safe_mm import LambdaSchedule
from alignrl.config import ConfigError
from alignrl.core.preference import DPO_LOSSES, reward_accuracy
from alignrl.data.blend import read_files
from alignrl.data.preference import PairColumns, encode_pairs, load_pairs, truncation_note


def check_scorers(cfg: DPOConfig) -> None:
    """The two judges: trained folders, sequence-classification models (a policy has no scoring head), each of its
    kind (a cost model is not the helpfulness judge)."""
    import json

    for key, task in (("helpful_rm", "helpful"), ("harmless_rm", "harmless")):
        path = getattr(cfg, key)
        if not (Path(path) / "config.json").is_file():
            raise ConfigError(f"{key}={path}: no trained model there; run `bash scripts/train_rm_distributed.sh "
                              f"{task} <NGPU>` first (or point {key} at a reward-model folder)")
        try:
            arch = json.loads((Path(path) / "config.json").read_text()).get("architectures") or []
        except (OSError, ValueError, AttributeError):
            arch = []
        if arch and not any(str(a).endswith("ForSequenceClassification") for a in arch):
            raise ConfigError(f"{key}={path} is a {arch[0]}, a policy, not a reward model: it "
                              f"has no scoring head; train one with `bash scripts/train_rm_distributed.sh {task} <NGPU>` "
                              f"and point {key} there")
        check_scorer_kind(key, path)


def _load(files: list[str], cfg: DPOConfig, limit: int, key: str, probs=()) -> tuple[list, list[int]]:
    """(pairs, file index of each): each file's first `limit` (0: all); blended by `probs` (`read_files`)."""
    columns = PairColumns(cfg.prompt_key, cfg.chosen_key, cfg.rejected_key)

    def read(f, n: int | None) -> list:
        return load_pairs(f, cfg.prefer, n, key, columns)

    if probs:
        picked = read_files(files, read, limit or None, probs, cfg.seed, key)
    else:
        picked = [(g, pair) for g, f in enumerate(files) for pair in read(f, limit or None)]
    return [pair for _, pair in picked], [g for g, _ in picked]


@torch.no_grad()
def per_pair_table(fn, batches, n: int, width: int, env) -> torch.Tensor:
    """(n, width) values of `fn(batch) -> (B, width)` for every pair of the data set: each rank fills
    its rows and one sum over ranks shares them (plain float tensors, nothing pickled)."""
    from alignrl.runtime.env import all_reduce_sum

    out = torch.zeros(n, width, dtype=torch.float64)
    for batch in batches:
        vals = fn(batch.to(env.device)).double().cpu()
        keep = batch.weight.bool()  # the batch stays on the CPU: `out` is indexed with its rows
        out[batch.index[keep]] = vals[keep]
    return torch.tensor(all_reduce_sum(env, out.flatten().tolist()), dtype=torch.float64).view(n, width)


def _scorer_table(cfg, enc, pairs, pad, env, log) -> torch.Tensor:
    """(N, 4) help_chosen, help_rejected, cost_chosen, cost_rejected of every training pair."""
    from alignrl.models.value import ModelScorer

    cols = []
    for key in ("helpful_rm", "harmless_rm"):
        path = getattr(cfg, key)
        sign = -1.0 if key == "harmless_rm" and score_info(path).get("model_type") == "reward" else 1.0
        scorer = ModelScorer(path, "bfloat16" if pc.use_bf16(cfg) else "float32", log=log.print)
        scorer.model.to(env.device)

        def score(b, s=scorer):
            v = s.score(b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)
            return torch.stack([v[:b.n_pairs], v[b.n_pairs:]], 1)

        cols.append(sign * per_pair_table(score, pc.eval_batches(enc, pairs, pad, cfg.eval_batch_size, env),
                                          len(enc), 2, env))
        del scorer
    return torch.cat(cols, 1).float()


@torch.no_grad()
def evaluate(model, ref_fn, batches, groups: list[int], names: list[str], beta: float, cfg, env) -> dict:
    """Held-out DPO metrics over all ranks, overall and per eval file: reward accuracy and margin of
    the implicit rewards β·(log π - log π_ref), and how often the policy itself gives the chosen
    response more probability than the rejected one."""
    from alignrl.runtime.env import all_reduce_sum

    was = model.training
    model.eval()
    k = len(names)
    sums = torch.zeros(k, 4, dtype=torch.float64)  # reward acc, margin, logp acc, pairs
    for batch in batches:
        batch = batch.to(env.device)
        with pc.autocast(cfg, env.device):
            pc_, pr_, _, _, _ = policy_logps(model, batch, cfg.logp_reduction, ld_alpha=cfg.ld_alpha)
        rc, rr, _ = ref_fn(batch)
        if cfg.loss_type in LENGTH_NORMALISED:  # the rewards the loss trains
            pc_, pr_ = token_means(pc_.float(), pr_.float(), batch, cfg.logp_reduction)
            rc, rr = token_means(rc, rr, batch, cfg.logp_reduction)
        ch, rj = beta * (pc_.float() - rc), beta * (pr_.float() - rr)
        w = batch.weight
        g = torch.tensor([groups[i] for i in batch.index.tolist()])
        rows = torch.stack([reward_accuracy(ch, rj) * w, (ch - rj) * w, reward_accuracy(pc_, pr_) * w, w], 1).double()
        sums.index_add_(0, g, rows.cpu())
    model.train(was)
    sums = torch.tensor(all_reduce_sum(env, sums.flatten().tolist()), dtype=torch.float64).view(k, 4)

    def block(s: torch.Tensor) -> dict:
        n = max(float(s[3]), 1.0)
        return {"reward_accuracy": float(s[0]) / n, "reward_margin": float(s[1]) / n,
                "logp_accuracy": float(s[2]) / n, "pairs": int(s[3])}

    return {"all": block(sums.sum(0)), **{names[i]: block(sums[i]) for i in range(k)}}


def _fmt_eval(e: dict) -> str:
    return (f"reward accuracy {e['reward_accuracy']:.3f}, margin {e['reward_margin']:+.3f}, "
            f"policy prefers chosen {e['logp_accuracy']:.3f}")


class _Reference:
    """The frozen reference's log-probs (chosen, rejected) of a batch, and its chosen response logits when the KL
    term needs them: from a copy of the initial policy (or of ref_model_path), from the policy itself with its LoRA
    adapters off, or, once `precompute` has run, from per-pair tables."""

    def __init__(self, cfg: DPOConfig, policy, env, lora: bool):
        from alignrl.models.loader import frozen_copy, load_model

        self.cfg, self.device, self.adapters_of = cfg, env.device, None
        self.tables: dict[str, torch.Tensor | None] = {"train": None, "eval": None}
        self.free = cfg.reference_free or cfg.loss_type in REFERENCE_FREE  # log-probs of 0, no model loaded
        if self.free or (lora and same_model(cfg.ref_model_path, cfg.model_path)):
            self.model = None  # set by `use_adapters_off` once the adapters are on
            return
        # copied before prepare_trainable changes the policy; nothing else holds the copy, so that dropping
        # self.model frees it
        self.model = (frozen_copy(policy) if same_model(cfg.ref_model_path, cfg.model_path) else
                      frozen_copy(load_model(cfg.ref_model_path, key="ref_model_path")[0]))
        self.model.to(env.device, torch.bfloat16 if pc.use_bf16(cfg) else torch.float32)

    def use_adapters_off(self, peft_model) -> None:
        self.adapters_of = peft_model

    @torch.no_grad()
    def logps(self, batch, keep_logits: bool = False):
        from alignrl.models.lora import adapters_off

        if self.adapters_of is not None:
            with adapters_off(self.adapters_of), pc.autocast(self.cfg, self.device):
                c, r, logits = pair_logps(self.adapters_of, batch, self.cfg.logp_reduction, keep_logits)
        else:
            c, r, logits = pair_logps(self.model, batch, self.cfg.logp_reduction, keep_logits)
        return c.float(), r.float(), logits

    def precompute(self, cfg: DPOConfig, env, log, pad: int, **data) -> None:
        """Tables of every pair of each `name=(encoded, pairs)` data set, then the copy is freed."""
        both = lambda b: torch.stack(self.logps(b)[:2], 1)  # noqa: E731
        for name, (enc, pairs) in data.items():
            self.tables[name] = per_pair_table(both, pc.eval_batches(enc, pairs, pad, cfg.eval_batch_size, env),
                                               len(enc), 2, env).float()
        self.model = None
        log.print("reference log-probs precomputed; the reference copy is freed")

    def __call__(self, batch, split: str, keep_logits: bool = False):
        if self.free:
            zero = torch.zeros(batch.n_pairs, device=self.device)
            return zero, zero, None
        table = self.tables[split]
        if table is None:
            return self.logps(batch, keep_logits)
        t = table[batch.index.cpu()].to(self.device)
        return t[:, 0], t[:, 1], None


def _loss_fn(cfg: DPOConfig, env, ref: _Reference, scores: torch.Tensor | None, lam: LambdaSchedule | None,
             bco: BcoDelta | None = None):
    """The training loss of a micro-batch; `scores`: the scorers' table of the safety losses (None for the others);
    `bco`: bco_pair's running reward mean (None without bco_pair)."""
    kl_on = cfg.kl_coeff > 0
    kw = dict(label_smoothing=cfg.label_smoothing, discopop_tau=cfg.discopop_tau, simpo_gamma=cfg.simpo_gamma)

    def loss(module, batch, gpairs):
        with pc.autocast(cfg, env.device):
            pc_, pr_, logits, weight, whole_c = policy_logps(module, batch, cfg.logp_reduction, kl_on, cfg.ld_alpha,
                                                             cfg.use_weighting)
            rc, rr, ref_logits = ref(batch, "train", kl_on)
        pc_, pr_ = pc_.float(), pr_.float()
        nll = chosen_nll(whole_c.float(), batch, cfg.logp_reduction)
        kl = response_kl(logits, ref_logits, batch.response_mask[:batch.n_pairs]) if kl_on else None
        if isinstance(cfg.loss_type, (list, tuple)):  # TRL's multi-loss DPO: each loss reads the log-probs it needs
            value, metrics = mixed_loss(cfg, pc_, pr_, rc, rr, nll, batch, gpairs, bco, weight, **kw)
            return _with_nll_and_kl(value, metrics, nll, kl, gpairs, weight)
        if cfg.loss_type in LENGTH_NORMALISED:  # the reference's too (simpo's and orpo's are zeros)
            pc_, pr_ = token_means(pc_, pr_, batch, cfg.logp_reduction)
            rc, rr = token_means(rc, rr, batch, cfg.logp_reduction)
        extra = {}
        if cfg.loss_type == "orpo":  # its NLL term is part of the loss
            extra = {"nll": nll}
        if cfg.loss_type == "bco_pair":
            extra = {"bco_delta": bco.update(pc_, pr_, rc, rr, cfg.beta)}
        if scores is not None:
            s = scores[batch.index.cpu()].to(env.device)
            if lam is not None:
                extra = {**lam.loss_kwargs(s, pc_, pr_), "kl": kl}
            else:
                extra = dict(help_chosen=s[:, 0], help_rejected=s[:, 1], cost_chosen=s[:, 2], cost_rejected=s[:, 3],
                             safety_lambda=cfg.safety_lambda, offset_alpha=cfg.offset_alpha)
        value, metrics = DPO_LOSSES[cfg.loss_type](pc_, pr_, rc, rr, cfg.beta, gpairs, **extra, **kw,
                                                   **trl_keywords(cfg, cfg.loss_type, pc_, pr_, rc, rr, weight))
        return _with_nll_and_kl(value, metrics, nll, kl, gpairs, weight)

    def _with_nll_and_kl(value, metrics, nll, kl, gpairs, weight=None):
        if cfg.nll_loss_coef:  # RPO, CPO: the chosen responses' own likelihood, each response's token mean
            value = value + cfg.nll_loss_coef * (nll if weight is None else nll * weight).sum() / gpairs
            metrics = {**metrics, "nll_loss": float(nll.detach().mean())}
        if kl_on and lam is None:  # the other losses take the KL term here; safe_mm_dpo adds its own
            value = value + cfg.kl_coeff * kl.sum() / gpairs
            metrics = {**metrics, "kl_divergence": float(kl.detach().mean())}
        return value, metrics

    return loss


def _trained_and_reference(cfg: DPOConfig, policy, spec, env, log):
    """(the module trained: the policy, or its peft wrapper under LoRA; the reference; its ReferenceSync with
    sync_ref_model, else None). The reference copy is taken before the policy changes."""
    ref = _Reference(cfg, policy, env, spec is not None)
    sync = ReferenceSync(cfg, ref.model, policy, log) if cfg.sync_ref_model else None  # a copy: cli refuses others
    pc.prepare_trainable(policy, cfg)
    if spec is None:
        return policy, ref, sync
    model = adapters.attach(policy, spec, "CAUSAL_LM", cfg.seed)
    if sync is not None:
        sync.lora_policy = model
    if ref.model is None and not ref.free:  # else ref_model_path's own copy stays the reference
        ref.use_adapters_off(model)
    which = ("none" if ref.free else "the policy with its adapters off" if ref.model is None else cfg.ref_model_path)
    log.print(f"LoRA r={spec.rank} alpha={spec.alpha} on {spec.target_modules}: {adapters.count(model)}; the reference "
              f"is {which}")
    return model, ref, sync


def train_dpo(cfg: DPOConfig, dry_run_world: int | None = None) -> dict:
    from alignrl.runtime.env import barrier, init_distributed, shutdown

    safety = cfg.loss_type in SAFETY_LOSSES
    if safety:
        check_scorers(cfg)
    train_pairs, _ = _load(list(cfg.train_files), cfg, cfg.max_train_pairs, "train_files", cfg.train_files_probs)
    eval_pairs, eval_group = _load(list(cfg.eval_files), cfg, cfg.max_eval_pairs, "eval_files")
    if dry_run_world:
        pc.check_enough(len(train_pairs), cfg, dry_run_world, ", ".join(cfg.train_files))
        return {}
    out_dir, log_dir = pc.run_folders(cfg, "models/aligned", "logs/training/dpo")
    t0 = time.time()
    env = init_distributed()
    pc.check_enough(len(train_pairs), cfg, env.world_size, ", ".join(cfg.train_files))
    log = pc.RankZeroLog(env, log_dir, cfg.report_to)
    policy, tok = pc.policy_and_tokenizer(cfg, env.device, log)
    pc.bind_template_variables(tok, cfg, log)
    spec = adapters.spec_of(cfg)
    model, ref, sync = _trained_and_reference(cfg, policy, spec, env, log)
    pad = tok.pad_token_id
    render = (cfg.apply_chat_template, cfg.input_template)  # the prompt's chat template, or OpenRLHF's/TRL's text
    enc_train, cut = encode_pairs(tok, train_pairs, cfg.max_length, *render)
    enc_eval, _ = encode_pairs(tok, eval_pairs, cfg.max_length, *render)
    log.print(f"DPO ({cfg.loss_type}, beta {cfg.beta}): {len(enc_train)} train pairs from {', '.join(cfg.train_files)}; "
              f"{len(enc_eval)} held-out; {truncation_note(enc_train, cut, cfg.max_length)}")
    if cfg.precompute_ref_log_probs:
        ref.precompute(cfg, env, log, pad, train=(enc_train, train_pairs), eval=(enc_eval, eval_pairs))
    scores = _scorer_table(cfg, enc_train, train_pairs, pad, env, log) if safety else None
    lam = LambdaSchedule(cfg, env, log) if cfg.loss_type == "safe_mm_dpo" else None
    total = pc.total_steps(len(enc_train), cfg, env.world_size)
    engine = pc.build_engine_for(cfg, model, env, total)
    log.print(f"{pc.describe_batch(cfg, env.world_size)}; {total} optimizer steps, strategy {engine.name}, "
              f"world size {env.world_size}, bf16 {pc.use_bf16(cfg)}, gradient checkpointing "
              f"{cfg.gradient_checkpointing}")
    evals = pc.eval_batches(enc_eval, eval_pairs, pad, cfg.eval_batch_size, env)
    names = [str(f).removeprefix("builtin:") for f in cfg.eval_files]
    ev = lambda: evaluate(engine.model, lambda b: ref(b, "eval"), evals, eval_group, names, cfg.beta,  # noqa: E731
                          cfg, env)
    before = ev()
    log.print("held-out before training: " + _fmt_eval(before["all"]))

    bco = BcoDelta(env) if uses_bco(cfg) else None
    plan = cp.plan_for(cfg, out_dir, total, pc.steps_per_epoch(len(enc_train), cfg, env.world_size))
    folder = cp.resume_folder(cfg, plan, log, env)
    start = ckpt.resume(folder, engine, lam, reference=sync, running=bco) if folder else 0
    if start:
        log.print(f"resumed from {folder} at step {start}" + (f", λ {lam.state.value:.6g}" if lam else ""))
    cp.set_aside(plan, start, env, log)
    export = adapters.exporter(policy, model, spec, cfg.lora_export)

    def after_step(step: int) -> dict[str, float]:  # collective: every rank reaches the same steps
        out = lam.after_step(step) if lam is not None else {}
        if sync is not None:  # before a checkpoint or an eval of this step, which then see the moved reference
            sync.after_step(step, engine)
        if pc.eval_due(cfg, step, plan):  # before the step's checkpoint, as transformers: its trainer_state has it
            e = ev()["all"]
            out.update(evals := {f"eval/{k}": e[k] for k in ("reward_accuracy", "reward_margin", "logp_accuracy")})
            log.record(step, evals)
        cp.save_if_due(plan, step, engine, env, log, export, tok, lam=lam, reference=sync, running=bco)
        return out

    step = pc.train_pairs(engine, _loss_fn(cfg, env, ref, scores, lam, bco), enc_train, train_pairs, pad, cfg, env,
                          log, total, {"rewards/accuracy": "acc", "rewards/margin": "margin", "safe/offset": "offset",
                                  "safe/swapped_frac": "swapped", "lambda": "lambda", "loss_helpful": "loss_H",
                                  "loss_safety": "loss_S", "kl_divergence": "kl"}, after_step, start)
    after = ev()
    pc.check_eval_finite(after["all"]["reward_margin"], "log-probabilities")
    results = _report(cfg, log, names, before, after, step, len(enc_train), env, engine.name, t0, lam)
    writer, state = export(engine.full_state_dict())  # collective
    files = {"eval_results.json": results, **(lam.files() if lam is not None else {})}
    pc.save_hf_folder(out_dir, writer, state, tok, files, env, log_dir=log_dir, keep=plan.inside(out_dir))
    log.metrics(step, {"eval/reward_accuracy": after["all"]["reward_accuracy"],
                       "eval/reward_accuracy_before": before["all"]["reward_accuracy"],
                       "eval/logp_accuracy": after["all"]["logp_accuracy"]})
    log.print(f"saved policy to {out_dir} ({results['seconds']:.1f}s)")
    barrier(env)
    shutdown()
    return results


def _report(cfg: DPOConfig, log, names: list[str], before: dict, after: dict, step: int, n_train: int, env,
            strategy: str, t0: float, lam: LambdaSchedule | None) -> dict:
    """The held-out metrics before -> after, printed, and the run's results (eval_results.json)."""
    log.print("held-out after training:  " + _fmt_eval(after["all"]))
    for name in names:
        log.print(f"  {name}: reward accuracy {before[name]['reward_accuracy']:.3f} -> "
                  f"{after[name]['reward_accuracy']:.3f}, policy prefers chosen {before[name]['logp_accuracy']:.3f} -> "
                  f"{after[name]['logp_accuracy']:.3f}")
    out = {"loss_type": cfg.loss_type, "beta": cfg.beta, "before": before, "after": after, "steps": step,
           "train_pairs": n_train, "world_size": env.world_size, "strategy": strategy, "use_lora": cfg.use_lora,
           "logp_reduction": cfg.logp_reduction, "kl_coeff": cfg.kl_coeff,
           "effective_batch": pc.global_batch(cfg, env.world_size), "seconds": round(time.time() - t0, 1)}
    if isinstance(cfg.loss_type, (list, tuple)):
        out.update(loss_weights=list(cfg.loss_weights) or [1.0] * len(cfg.loss_type))
    if cfg.loss_type in SAFETY_LOSSES:
        out.update(helpful_rm=cfg.helpful_rm, harmless_rm=cfg.harmless_rm)
    if cfg.loss_type == "safe_odpo":
        out.update(safety_lambda=cfg.safety_lambda, offset_alpha=cfg.offset_alpha)
    if lam is not None:
        out.update(lambda_init=cfg.lambda_init, lambda_final=lam.state.value, lambda_lr=cfg.lambda_lr,
                   cost_threshold=cfg.cost_threshold, beta_w=cfg.beta_w, beta_k=cfg.beta_k)
        log.print(f"λ {cfg.lambda_init:g} -> {lam.state.value:.6g} after {lam.state.updates} updates")
    return out
