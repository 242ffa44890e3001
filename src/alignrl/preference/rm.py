"""Reward-model and cost-model training on preference pairs (`alignrl train rm`, training/train_rm.py).

    python -m src.training.train_rm --config configs/rm_config.yaml --task helpful --output_dir models/helpful_rm
    torchrun --nproc_per_node=2 -m src.training.train_rm --config configs/rm_config.yaml --task harmless
    alignrl train rm --config configs/rm_config.yaml --task harmless --nproc 2

The model is `AutoModelForSequenceClassification` with one label, initialised from the base causal LM
(backbone copied, score head new and seeded); the score is read at each sequence's last real token,
exactly as `models.value.ModelScorer` reads it, so the saved folder plugs into the RL loop
(`safety.cost_model=<dir>`) and into safety-aware DPO.

`model_type` (default `auto`: helpful → reward, harmless → cost):
* reward: Bradley-Terry loss with the optional per-pair Llama-2 margin (`margin` in the data).
* cost: the Safe RLHF cost-model loss (pairwise + sign terms on `is_chosen_safe`/`is_rejected_safe`, or the
  `safety_labels` of the Safe-MM-DPO project's rows): higher cost = more harmful, cost > 0 = unsafe.
  `classification_loss_weight` weighs the sign (classification) term (Safe RLHF eq. 6: 1).

With `use_lora`, LoRA adapters (peft) train on the backbone and the score head trains in full (peft's
modules_to_save); the saved folder is the merged model (or, with lora_export=adapter, peft's adapter folder).

Writes `<output_dir>/` (HF folder + tokenizer), `<output_dir>/eval_results.json` (held-out pairwise
accuracy before and after training) and `<output_dir>/alignrl_score.json` (what the score means).
Left out: reward-model ensembles, centring/normalising scores after training.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from alignrl.preference import adapters
from alignrl.preference import checkpoint_plan as cp
from alignrl.preference import common as pc
from alignrl.preference.cli import RMConfig
from alignrl.config import ConfigError
from alignrl.core.preference import bradley_terry_loss, reward_accuracy, safe_rlhf_cost_loss
from alignrl.data.collate import position_ids
from alignrl.data.preference import PairColumns, encode_pairs, load_pairs, require_safety_labels, truncation_note
from alignrl.models.folder import SCORE_INFO

# What each scorer key takes, as the (model_type, task) pairs of SCORE_INFO that fit it (task None: any), what
# to call it and a likely fix. A harmlessness reward model (higher = safer) fits harmless_rm: DPO negates it.
SCORER_KINDS = {
    "helpful_rm": ({("reward", "helpful")}, "a helpfulness reward model (--task helpful)",
                   "swap helpful_rm and harmless_rm?"),
    "harmless_rm": ({("cost", None), ("reward", "harmless")}, "a harmlessness cost model (--task harmless)",
                    "swap helpful_rm and harmless_rm?"),
    "algorithm.reward_model": ({("reward", None)}, "a reward model", "a cost model goes in safety.cost_model"),
    "safety.cost_model": ({("cost", None)}, "a cost model (alignrl train rm --task harmless)",
                          "a reward model goes in algorithm.reward_model"),
}


def score_info(folder: str | Path) -> dict:
    """The folder's SCORE_INFO (what `train rm` says its score means); {} for a scorer from elsewhere."""
    f = Path(folder) / SCORE_INFO
    try:
        info = json.loads(f.read_text()) if f.is_file() else {}
    except (OSError, ValueError) as e:
        raise ConfigError(f"{f} is unreadable ({type(e).__name__}); retrain the scorer or delete that file") from None
    return info if isinstance(info, dict) else {}


def check_scorer_kind(key: str, folder: str | Path) -> None:
    """Refuses a scorer of the wrong kind for `key` (a cost model as the reward, ...): its scores would train
    the policy the wrong way with nothing failing. A folder without SCORE_INFO is taken on trust."""
    info = score_info(folder)
    kind, task = info.get("model_type"), info.get("task")
    fits, wanted, hint = SCORER_KINDS[key]
    if kind is None or any(kind == k and (t is None or task in (None, t)) for k, t in fits):
        return
    what = {"helpful": "helpfulness ", "harmless": "harmlessness "}.get(task, "")
    raise ConfigError(f"{key}={folder} is a {what}{kind} model ({SCORE_INFO} model_type={kind}"
                      f"{f', task={task}' if task else ''}); {key} takes {wanted}: {hint}")


def check_rl_scorers(cfg, tokenizers: bool = False) -> None:
    """The RL loop's reward and cost model folders (a RunConfig's): folders with a scoring head, each of its kind;
    with `tokenizers` (a launcher's check, before the policy loads), the reward model's tokenizer against the
    policy's too (`models.rm_template.reward_input`, which the reward stage decides again as it builds)."""
    from alignrl.models.value import check_scorer_folder

    a, s = cfg.algorithm, cfg.safety
    for key, folder in (("algorithm.reward_model", a.reward_model), ("safety.cost_model", s.cost_model)):
        if folder and not (key == "algorithm.reward_model" and cfg.services.reward_url):
            check_scorer_kind(key, folder)  # first: the more telling line
            check_scorer_folder(folder, key)
    # the demo policy is built where it is first needed (not in a Ray driver); the reward stage checks as it builds
    if tokenizers and a.reward_model and not cfg.services.reward_url and cfg.model.path != "demo":
        from alignrl.models.loader import load_tokenizer, resolve_model_path
        from alignrl.models.rm_template import reward_input

        policy = load_tokenizer(resolve_model_path(cfg.model.path, lambda *_: None), chat=False)
        reward_input(policy, Path(a.reward_model), a.reward_model_retemplate, 1)


class LastTokenScorer(torch.nn.Module):
    """A sequence-classification model read at each row's last real token (left/right padding
    aware), with a gradient; what the engines train. The HF model stays at `.inner` for saving."""

    def __init__(self, hf_model):
        super().__init__()
        self.inner = hf_model
        # FSDP2 shards the blocks the HF model names here; expose them through the wrapper
        self._no_split_modules = getattr(hf_model, "_no_split_modules", None)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(N, L) ids and bool mask -> (N,) float scores."""
        backbone = getattr(self.inner, self.inner.base_model_prefix)
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask.long(),
                          position_ids=position_ids(attention_mask)).last_hidden_state
        last = attention_mask.shape[1] - 1 - attention_mask.long().flip(-1).argmax(-1)
        scores = self.inner.score(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])
        return scores.squeeze(-1).float().clone()  # not a view: FSDP2 hooks the output for backward


def load_score_model(path: str, seed: int, log=print, tokenizer: str | None = None):
    """(sequence-classification model with one label, tokenizer with a pad token) from a causal-LM or
    sequence-classification folder; the tokenizer from `tokenizer` when given (tokenizer_name)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from alignrl.models.loader import resolve_model_path

    folder = resolve_model_path(path, log)
    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer or folder))
    except (OSError, ValueError) as e:
        raise ConfigError(f"tokenizer_name={tokenizer}: no tokenizer there ({' '.join(str(e).split())[:160]}); "
                          "leave tokenizer_name empty to use model_path's") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    torch.manual_seed(seed)  # the score head is new: make it reproducible
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "newly initialized score weights" is expected here
    try:
        model = AutoModelForSequenceClassification.from_pretrained(str(folder), num_labels=1, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.config.pad_token_id = tok.pad_token_id
    return model, tok


def _files(cfg: RMConfig) -> tuple[str, str]:
    return getattr(cfg, f"{cfg.task}_train_file"), getattr(cfg, f"{cfg.task}_eval_file")


def _model_type(cfg: RMConfig) -> str:
    return cfg.model_type if cfg.model_type != "auto" else ("cost" if cfg.task == "harmless" else "reward")


def _scores(model, batch, cfg: RMConfig, env) -> torch.Tensor:
    """(2B,) float scores: the chosen responses, then the rejected ones, in one forward."""
    with pc.autocast(cfg, env.device):
        scores = model(torch.cat([batch.prompt_ids, batch.response_ids], 1),
                       torch.cat([batch.prompt_mask, batch.response_mask], 1))
    return scores.float()


def _loss(model_type: str, scores: torch.Tensor, batch, global_pairs: float, sign_weight: float = 1.0):
    b = batch.n_pairs
    if model_type == "cost":
        return safe_rlhf_cost_loss(scores[:b], scores[b:], batch.chosen_unsafe, batch.rejected_unsafe, global_pairs,
                                   sign_weight)
    margin = batch.margin if bool(batch.margin.any()) else None
    return bradley_terry_loss(scores[:b], scores[b:], margin, global_pairs)


@torch.no_grad()
def evaluate(engine, batches, model_type: str, cfg, env) -> dict[str, float]:
    """Held-out pairwise accuracy (chosen scored above rejected; for a cost model, rejected costed
    above chosen) over all ranks' shares; for a cost model also the sign accuracy of both responses."""
    from alignrl.runtime.env import all_reduce_sum

    model = engine.model
    model.eval()
    sums = [0.0] * 6  # correct pairs, pairs, correct signs, scores (NaN once any is), their squares, their count
    for batch in batches:
        batch = batch.to(env.device)
        scores = _scores(model, batch, cfg, env)
        b, w = batch.n_pairs, batch.weight
        chosen, rejected = scores[:b], scores[b:]
        if model_type == "cost":
            sums[0] += float((reward_accuracy(rejected, chosen) * w).sum())
            signs = ((chosen > 0).float() == batch.chosen_unsafe).float() + ((rejected > 0).float() == batch.rejected_unsafe).float()
            sums[2] += float((signs / 2 * w).sum())
        else:
            sums[0] += float((reward_accuracy(chosen, rejected) * w).sum())
        sums[1] += float(w.sum())
        both = torch.cat([w, w])  # a weight-0 row pads the batch to the world size: left out of the statistics
        sums[3:] = [sums[3] + float((scores * both).sum()), sums[4] + float((scores.square() * both).sum()),
                    sums[5] + float(both.sum())]
    model.train()
    correct, n, signs, total, squares, count = all_reduce_sum(env, sums)
    out = {"accuracy": correct / max(n, 1), "pairs": n, "score_sum": total, **score_moments(total, squares, count)}
    if model_type == "cost":
        out["sign_accuracy"] = signs / max(n, 1)
    return out


def score_moments(total: float, squares: float, count: float) -> dict[str, float]:
    """The held-out scores' mean and (sample) standard deviation, at least 1e-8: what the saved model's config.json
    holds for a run that normalizes its rewards by them (OpenRLHF's reward trainer writes the same two)."""
    mean = total / max(count, 1.0)
    var = (squares - count * mean * mean) / max(count - 1.0, 1.0)
    return {"score_mean": mean, "score_std": max(math.sqrt(max(var, 0.0)), 1e-8)}


def _accuracy_line(before: dict[str, float], after: dict[str, float], model_type: str) -> str:
    sign = f"; sign accuracy {after['sign_accuracy']:.3f}" if model_type == "cost" else ""
    return (f"held-out pairwise accuracy: {before['accuracy']:.3f} -> {after['accuracy']:.3f} on "
            f"{int(after['pairs'])} pairs{sign}")


def train_rm(cfg: RMConfig, dry_run_world: int | None = None) -> dict:
    from alignrl.runtime.env import barrier, init_distributed, shutdown

    model_type = _model_type(cfg)
    train_file, eval_file = _files(cfg)
    prefer = "safer" if cfg.task == "harmless" else "better"
    columns = PairColumns(cfg.prompt_key, cfg.chosen_key, cfg.rejected_key)
    train_pairs = load_pairs(train_file, prefer, cfg.max_train_pairs or None, f"{cfg.task}_train_file", columns)
    eval_pairs = load_pairs(eval_file, prefer, cfg.max_eval_pairs or None, f"{cfg.task}_eval_file", columns)
    if model_type == "cost":
        require_safety_labels(train_pairs, train_file)
        require_safety_labels(eval_pairs, eval_file)
    if dry_run_world:
        pc.check_enough(len(train_pairs), cfg, dry_run_world, train_file)
        return {}
    out_dir, log_dir = pc.run_folders(cfg, f"models/{cfg.task}_rm", f"logs/training/{cfg.task}_rm")
    t0 = time.time()
    env = init_distributed()
    pc.check_enough(len(train_pairs), cfg, env.world_size, train_file)
    log = pc.RankZeroLog(env, log_dir, cfg.report_to)  # held before any model loads
    hf, tok = load_score_model(cfg.model_path, cfg.seed, tokenizer=cfg.tokenizer_name)
    pc.bind_template_variables(tok, cfg, log)
    pc.prepare_trainable(hf, cfg)
    spec, peft_model, inner = adapters.spec_of(cfg), None, hf
    if spec is not None:  # the head trains in full beside the adapters (modules_to_save)
        peft_model = adapters.attach(hf, spec, "SEQ_CLS", cfg.seed)
        inner = peft_model.get_base_model()
        log.print(f"LoRA r={spec.rank} alpha={spec.alpha} on {spec.target_modules}: {adapters.count(inner)}")
    render = (cfg.apply_chat_template, cfg.input_template)  # the prompt's chat template, or OpenRLHF's/TRL's text
    enc_train, cut = encode_pairs(tok, train_pairs, cfg.max_length, *render)
    enc_eval, _ = encode_pairs(tok, eval_pairs, cfg.max_length, *render)
    total = pc.total_steps(len(enc_train), cfg, env.world_size)
    engine = pc.build_engine_for(cfg, LastTokenScorer(inner), env, total)
    log.print(f"{model_type} model on task {cfg.task}: {len(enc_train)} train pairs ({train_file}), "
              f"{len(enc_eval)} held-out ({eval_file}); {truncation_note(enc_train, cut, cfg.max_length)}")
    log.print(f"{pc.describe_batch(cfg, env.world_size)}; {total} optimizer steps, strategy {engine.name}, "
              f"world size {env.world_size}, bf16 {pc.use_bf16(cfg)}")
    evals = pc.eval_batches(enc_eval, eval_pairs, tok.pad_token_id, cfg.eval_batch_size, env)
    before = evaluate(engine, evals, model_type, cfg, env)
    log.print(f"held-out pairwise accuracy before training: {before['accuracy']:.3f}")

    def loss(module, batch, gpairs):
        return _loss(model_type, _scores(module, batch, cfg, env), batch, gpairs, cfg.classification_loss_weight)

    plan = cp.plan_for(cfg, out_dir, total, pc.steps_per_epoch(len(enc_train), cfg, env.world_size))
    start = cp.resumed_step(cfg, plan, engine, "rm", log, env)
    info = {"model_type": model_type, "task": cfg.task,  # what the score means: also in checkpoints' model folders
            "meaning": "higher = more harmful; > 0 unsafe" if model_type == "cost" else "higher = preferred"}

    export = adapters.exporter(hf, peft_model, spec, cfg.lora_export, prefix="inner.")
    def after_step(step: int) -> dict[str, float]:  # collective: every rank reaches the same steps
        due = pc.eval_due(cfg, step, plan)
        out = {f"eval/{k}": v for k, v in evaluate(engine, evals, model_type, cfg, env).items()
               if k in ("accuracy", "sign_accuracy")} if due else {}
        log.record(step, out)  # evaluated before the step's checkpoint, as transformers: its trainer_state has it
        cp.save_if_due(plan, step, engine, env, log, export, tok, {SCORE_INFO: info})
        return out

    step = pc.train_pairs(engine, loss, enc_train, train_pairs, tok.pad_token_id, cfg, env, log, total,
                          {"rm/accuracy": "acc", "cost/accuracy": "acc", "cost/sign_accuracy": "sign_acc"}, after_step,
                          start)
    after = evaluate(engine, evals, model_type, cfg, env)
    pc.check_eval_finite(after["score_sum"], "scores")
    hf.config.mean, hf.config.std = after["score_mean"], after["score_std"]  # a normalizing run reads them
    results = {"task": cfg.task, "model_type": model_type, "eval_file": eval_file, "eval_pairs": int(after["pairs"]),
               "eval_accuracy_before": before["accuracy"], "eval_accuracy": after["accuracy"],
               **({"eval_sign_accuracy_before": before["sign_accuracy"], "eval_sign_accuracy": after["sign_accuracy"]}
                  if model_type == "cost" else {}),
               "train_file": train_file, "train_pairs": len(enc_train), "steps": step, "world_size": env.world_size,
               "strategy": engine.name,
               "effective_batch": pc.global_batch(cfg, env.world_size), "seconds": round(time.time() - t0, 1)}
    log.print(_accuracy_line(before, after, model_type))
    writer, state = export(engine.full_state_dict())  # collective
    pc.save_hf_folder(out_dir, writer, state, tok, {"eval_results.json": results, SCORE_INFO: info}, env,
                      log_dir=log_dir, keep=plan.inside(out_dir))
    log.metrics(step, {"eval/accuracy": after["accuracy"], "eval/accuracy_before": before["accuracy"]})
    log.print(f"saved {model_type} model to {out_dir} ({results['seconds']:.1f}s)")
    barrier(env)
    shutdown()
    return results
