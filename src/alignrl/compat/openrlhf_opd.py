"""`alignrl train opd` (OpenRLHF's `train_opd` flags): on-policy distillation as the one RL loop's recipe.

The student (--model.model_name_or_path) samples one completion per prompt; the teacher
(--teacher.model_name_or_path, model.ref_path) scores it; each token's reward is the teacher's log-prob minus the
student's (the KL term in the reward: k1, coefficient 1, fixed), with no task reward (algorithm.reward_fn=zero) and
no discount, and the student takes one on-policy update per batch (docs/algorithms.md, "On-policy distillation").
OpenRLHF's gradient is the same reverse-KL score-function estimator. The data, batch, optimizer, checkpoint and
logging flags map to their alignrl keys with OpenRLHF's defaults; the run is `alignrl train ppo` on those keys, and
the final model is copied into --ckpt.output_dir as OpenRLHF leaves it there.
"""

from __future__ import annotations

import json
import math
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from alignrl.compat import openrlhf_sources as S
from alignrl.compat.openrlhf_flags import SCHEDULERS, WANDB_SWITCHES
from alignrl.config import ConfigError, load_config
from alignrl.errors import FLAGS_ENV, PROGRAM_ENV, in_flag_words
from alignrl.runtime.one_line import OneLineParser

PROG = "alignrl train opd"
# the on-policy distillation recipe (docs/algorithms.md): the reward is the teacher's log-prob minus the student's
RECIPE = ["algorithm.use_kl_in_reward=true", "algorithm.kl_coef=1", "algorithm.kl_penalty=k1",
          "algorithm.kl_ctrl_type=fixed", "algorithm.adv_estimator=reinforce_plus_plus", "algorithm.gamma=0",
          "algorithm.whiten_advantages=none", "actor.use_kl_loss=false", "actor.ppo_epochs=1", "rollout.n=1",
          "algorithm.reward_fn=zero"]
# flags train_opd translates: (flag, type, OpenRLHF's default); bool: a switch
MAPPED = [("model.model_name_or_path", str, None), ("teacher.model_name_or_path", str, None),
          ("data.prompt_dataset", str, None), ("data.prompt_probs", str, None), ("data.prompt_split", str, "train"),
          ("data.input_key", str, "input"), ("data.input_template", str, None),
          ("data.apply_chat_template", bool, False), ("data.prompt_max_len", int, 1024), ("data.max_len", int, 512),
          ("data.max_samples", int, 1_000_000), ("train.batch_size", int, 128), ("train.micro_batch_size", int, 8),
          ("train.max_epochs", int, 1), ("train.seed", int, 42), ("generate.max_new_tokens", int, 1024),
          ("generate.temperature", float, 1.0), ("generate.top_p", float, 1.0), ("adam.lr", float, 1e-6),
          ("adam.weight_decay", float, 0.0), ("lr_scheduler", str, "cosine_with_min_lr"),
          ("lr_warmup_ratio", float, 0.03), ("min_lr_ratio", float, 0.1), ("max_norm", float, 1.0),
          ("ckpt.output_dir", str, "./ckpt"), ("ckpt.path", str, "./ckpt/checkpoints_dpo"),
          ("ckpt.save_steps", int, -1), ("ckpt.max_num", int, 3), ("ckpt.load_enable", bool, False),
          ("logger.wandb.key", str, None), ("logger.wandb.project", str, "openrlhf_train_dpo"),
          ("logger.wandb.run_name", str, None), ("logger.tensorboard_dir", str, None), ("eval.dataset", str, None),
          ("eval.steps", int, -1), ("ds.zero_stage", int, 2), ("ds.adam_offload", bool, False),
          ("ds.lora.rank", int, 0), ("ds.lora.alpha", int, 16), ("ds.lora.dropout", float, 0.0),
          ("model.gradient_checkpointing_enable", bool, False), ("ds.packing_samples", bool, False),
          ("opd.topk", int, 0), ("optim", str, "adam"), ("ds.tensor_parallel_size", int, 1),
          ("ds.ring_attn_size", int, 1), ("ds.load_in_4bit", bool, False)]
# flags accepted that change nothing here, by reason; a value other than the default is named at start
NOT_APPLIED = {
    "the reward is always k1, the teacher's log-prob minus the student's (OpenRLHF's gradient is that estimator "
    "too; its --opd.kl_estimator changes a logged metric)": [("opd.kl_estimator", str, "k3")],
    "it applies to the top-k mode only (--opd.topk > 0)": [("opd.kd_temperature", float, 1.0)],
    "it applies to --optim muon only": [("muon.lr", float, 0.02), ("muon.momentum", float, 0.95),
                                        ("muon.ns_steps", int, 5)],
    "not applied here: alignrl checkpoints are HF folders with their optimizer state": [
        ("ckpt.save_hf", bool, False), ("ckpt.disable_ds", bool, False), ("ckpt.max_mem", int, 100_000_000),
        ("ds.use_universal_ckpt", bool, False)],
    "not applied here: every step is logged; wandb takes the run folder's name and the default entity": [
        ("logger.logging_steps", int, 1), ("logger.wandb.org", str, None), ("logger.wandb.group", str, None)],
    "not applied here: DeepSpeed, kernel and loader options alignrl does not use": [
        ("ds.zpg", int, 1), ("ds.attn_implementation", str, "flash_attention_2"),
        ("ds.experts_implementation", str, None), ("ds.use_liger_kernel", bool, False),
        ("ds.grad_accum_dtype", str, None), ("ds.overlap_comm", bool, False), ("ds.deepcompile", bool, False),
        ("model.gradient_checkpointing_reentrant", bool, False), ("data.disable_fast_tokenizer", bool, False),
        ("data.dataloader_num_workers", int, 0), ("ds.ring_attn_head_stride", int, 1),
        ("train.full_determinism_enable", bool, False), ("local_rank", int, -1), ("use_ms", bool, False),
        ("model.aux_loss_coef", float, 0.0), ("adam.eps", float, 1e-8)],
    "not used by train_opd (its loss has no beta)": [("model.beta", float, 0.1)],
    "the held-out prompts are read whole": [("eval.split", str, "train")],
    "no task reward reads an answer (the reward is the teacher's)": [("data.label_key", str, "label")],
}


class OpdFlagError(ConfigError):
    """A train_opd flag asking for what is not available here, or what OpenRLHF refuses; one line."""


CHOICES = {"opd.kl_estimator": ("k1", "k2", "k3"),
           "ds.experts_implementation": ("eager", "batched_mm", "grouped_mm", "deepgemm")}


def parser(prog: str = PROG) -> OneLineParser:
    p = OneLineParser(prog=prog, description="On-policy distillation with OpenRLHF's train_opd flags: the student "
                      "samples, the teacher's log-prob minus the student's is each token's reward (alignrl's RL loop "
                      "with model.ref_path as the teacher).")
    for flag, kind, default in MAPPED + [e for entries in NOT_APPLIED.values() for e in entries]:
        if flag in CHOICES:
            p.add_argument(f"--{flag}", dest=flag, choices=CHOICES[flag], default=default)  # OpenRLHF's choices
        elif kind is bool:
            p.add_argument(f"--{flag}", dest=flag, action="store_true")
        else:
            p.add_argument(f"--{flag}", dest=flag, type=kind, default=default)
    p.add_argument("--adam.betas", dest="adam.betas", type=float, nargs=2, default=[0.9, 0.95])
    p.add_argument("--ds.param_dtype", dest="ds.param_dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--ds.lora.target_modules", dest="ds.lora.target_modules", nargs="*", default=["all-linear"])
    p.add_argument("--muon.nesterov", dest="muon.nesterov", action="store_true", default=True)
    p.add_argument("--muon.no_nesterov", dest="muon.nesterov", action="store_false")
    p.add_argument("--val_size", type=int, default=64, help="alignrl: held-out prompts of the final evaluation")
    return p


# what this command's errors may name (the prompt counting's ppo-ray flags, the run's config keys), said as its flags
FLAG_NAMES = {"--prompt_data_probs": "--data.prompt_probs", "--prompt_data": "--data.prompt_dataset",
              "--max_samples": "--data.max_samples", "--prompt_split": "--data.prompt_split",
              "model.path": "--model.model_name_or_path", "model.ref_path": "--teacher.model_name_or_path",
              "data.train_files_probs": "--data.prompt_probs", "data.train_files": "--data.prompt_dataset",
              "data.train_max_samples": "--data.max_samples", "data.prompt_key": "--data.input_key",
              "data.max_prompt_length": "--data.prompt_max_len", "data.train_batch_size": "--train.batch_size",
              "actor.ppo_micro_batch_size": "--train.micro_batch_size", "rollout.max_new_tokens":
              "--generate.max_new_tokens", "actor.lr": "--adam.lr", "trainer.seed": "--train.seed",
              "trainer.total_epochs": "--train.max_epochs", "trainer.checkpoint_dir": "--ckpt.path",
              "model.lora_rank": "--ds.lora.rank", "model.load_in_4bit": "--ds.load_in_4bit"}


def flag_names(a: dict) -> dict[str, str]:
    """FLAG_NAMES with the held-out prompts' key as the flag that set it."""
    return {**FLAG_NAMES, "data.val_files": "--eval.dataset" if a["eval.dataset"] else "--data.prompt_dataset"}


@contextmanager
def speaking_as(prog: str, names: dict[str, str]):
    """The run's own lines (and its ranks') name this command and its flags (`alignrl.errors`), until it returns."""
    before = {k: os.environ.get(k) for k in (PROGRAM_ENV, FLAGS_ENV)}
    os.environ.update({PROGRAM_ENV: prog, FLAGS_ENV: json.dumps(names)})
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check(a: dict) -> None:
    """OpenRLHF's own refusals of train_opd, and what is not available here, one line each."""
    for flag in ("model.model_name_or_path", "teacher.model_name_or_path", "data.prompt_dataset"):
        if not a[flag]:
            raise OpdFlagError(f"--{flag} is required")
    refusals = [
        (a["opd.topk"] > 0, "--opd.topk > 0: the top-k full-distribution mode is not in the loop here; use 0 "
                            "(the sampled-token reverse KL)"),
        (a["opd.topk"] < 0, "--opd.topk must be 0 or more"),
        (a["optim"] != "adam", f"--optim {a['optim']}: Muon is not available here; use --optim adam"),
        (a["ds.zero_stage"] > 2, "--ds.zero_stage 3: OpenRLHF's train_opd does not support ZeRO stage 3 either; "
                                 "use 2 or less"),
        (a["ds.tensor_parallel_size"] != 1, "--ds.tensor_parallel_size: tensor parallelism is not supported "
                                            "(OpenRLHF's train_opd refuses it too); use 1"),
        (a["ds.ring_attn_size"] > 1, "--ds.ring_attn_size: ring attention is not available here; use 1"),
        (a["ds.load_in_4bit"] and not a["ds.lora.rank"],
         "--ds.load_in_4bit quantizes the frozen base under LoRA adapters (QLoRA), and trains nothing without them: "
         "add --ds.lora.rank (e.g. 16), or drop --ds.load_in_4bit"),
        (a["opd.kd_temperature"] <= 0, "--opd.kd_temperature must be above 0 (OpenRLHF refuses it too)"),
        (a["data.max_samples"] < 1, "--data.max_samples must be at least 1"),
        (a["generate.max_new_tokens"] <= 0, "--generate.max_new_tokens must be a positive integer"),
        (a["generate.temperature"] != 1.0 or a["generate.top_p"] != 1.0,
         "--generate.temperature and --generate.top_p must be 1.0 with --opd.topk 0 (OpenRLHF refuses other "
         "values too: the reward is the KL to the student's own sampling distribution)"),
        (a["data.prompt_max_len"] + a["generate.max_new_tokens"] > a["data.max_len"],
         f"--data.prompt_max_len {a['data.prompt_max_len']} + --generate.max_new_tokens "
         f"{a['generate.max_new_tokens']} exceeds --data.max_len {a['data.max_len']} (OpenRLHF refuses it too): "
         "raise --data.max_len or lower the others"),
        (a["lr_scheduler"] not in SCHEDULERS, f"--lr_scheduler {a['lr_scheduler']}: alignrl takes "
                                              f"{', '.join(SCHEDULERS)}"),
        (a["train.batch_size"] < 1 or a["train.micro_batch_size"] < 1,
         "--train.batch_size and --train.micro_batch_size must be at least 1"),
    ]
    for refused, line in refusals:
        if refused:
            raise OpdFlagError(line)
    key = a["logger.wandb.key"]
    if key and key.lower() not in WANDB_SWITCHES and (not key.isprintable() or any(c.isspace() for c in key)):
        raise OpdFlagError("--logger.wandb.key: the value has spaces or unprintable characters")


def _sources(a: dict) -> SimpleNamespace:
    """The prompt flags in the names openrlhf_sources reads (ppo-ray's), to count and blend the same way."""
    return SimpleNamespace(prompt_data=a["data.prompt_dataset"], prompt_split=a["data.prompt_split"],
                           max_samples=a["data.max_samples"], prompt_data_probs=a["data.prompt_probs"],
                           seed=a["train.seed"])


def steps_per_epoch(a: dict) -> int:
    """OpenRLHF's `len(train_dataset) // batch_size` (the prompts counted as ppo-ray counts them)."""
    rows = S.prompt_rows(_sources(a))
    if rows < a["train.batch_size"]:
        raise OpdFlagError(f"--data.prompt_dataset has {rows} prompt(s), fewer than --train.batch_size "
                           f"{a['train.batch_size']}: lower it or give more data")
    return rows // a["train.batch_size"]


def data_keys(a: dict) -> list[str]:
    """The prompt files and columns as OpenRLHF's PromptDataset reads them: --data.input_key's column, through the
    chat template or --data.input_template (one without {} is dropped, as OpenRLHF drops it)."""
    template = a["data.input_template"] if not a["data.apply_chat_template"] else None
    out = [f"data.train_files={S.files_value(a['data.prompt_dataset'], a['data.prompt_split'])}",
           *S.probs_keys(_sources(a)), f"data.train_max_samples={a['data.max_samples']}",
           f"data.prompt_key={json.dumps(a['data.input_key'])}",
           f"data.apply_chat_template={str(a['data.apply_chat_template']).lower()}",
           f"data.input_template={json.dumps(template) if template and '{}' in template else 'null'}",
           f"data.max_prompt_length={a['data.prompt_max_len']}", "data.truncation=right",
           # held-out prompts only with --eval.dataset, as OpenRLHF: else one training prompt, the loop's minimum
           # (its accuracy is the zero reward's; the distillation's progress is actor/reward_kl_penalty)
           f"data.val_size={a['val_size'] if a['eval.dataset'] else 1}",
           f"data.val_size_during_training={a['val_size'] if a['eval.dataset'] else 1}",
           "data.val_files=" + (S.files_value(a["eval.dataset"], a["eval.split"]) if a["eval.dataset"] else
                                S.files_value(a["data.prompt_dataset"], a["data.prompt_split"]))]
    return out


def optimiser_keys(a: dict, total: int) -> list[str]:
    """AdamW, OpenRLHF's scheduler (warm-up over --lr_warmup_ratio of the steps, then cosine to --min_lr_ratio of
    the rate, or constant/linear) and the gradient clip."""
    schedule, floor = SCHEDULERS[a["lr_scheduler"]]
    floor = a["min_lr_ratio"] if a["lr_scheduler"] == "cosine_with_min_lr" else floor
    warmup = 0.0 if a["lr_scheduler"] == "constant" else a["lr_warmup_ratio"]
    betas = a["adam.betas"]
    return [f"actor.lr={a['adam.lr']}", f"actor.betas=[{betas[0]},{betas[1]}]",
            f"actor.weight_decay={a['adam.weight_decay']}", f"actor.lr_scheduler={schedule}",
            f"actor.min_lr_ratio={floor}", f"actor.lr_warmup_steps_ratio={warmup}", f"actor.grad_clip={a['max_norm']}",
           # OpenRLHF's count, ceil(steps × ratio), not the ratio's floor (0 under 34 steps at its 0.03)
           f"actor.lr_warmup_steps={math.ceil(total * warmup)}"]


def run_keys(a: dict, gpus: bool, per_epoch: int) -> list[str]:
    """Batches, steps, checkpoints, logging and the engine: one update per batch of --train.batch_size prompts,
    --train.max_epochs passes over them (OpenRLHF's max_steps)."""
    save = Path(a["ckpt.output_dir"]).absolute()
    batch, epochs = a["train.batch_size"], a["train.max_epochs"]
    test_freq = (a["eval.steps"] if a["eval.steps"] > 0 else per_epoch) if a["eval.dataset"] else 0
    wandb = bool(a["logger.wandb.key"]) and WANDB_SWITCHES.get(a["logger.wandb.key"].lower(), True)
    tb = a["logger.tensorboard_dir"]
    out = [f"data.train_batch_size={batch}", f"actor.ppo_mini_batch_size={batch}",
           f"actor.ppo_micro_batch_size={a['train.micro_batch_size']}",
           f"actor.logprob_micro_batch_size={a['train.micro_batch_size']}",
           f"rollout.max_new_tokens={a['generate.max_new_tokens']}", "rollout.temperature=1", "rollout.top_p=1",
           f"trainer.total_epochs={epochs}", f"trainer.total_training_steps={epochs * per_epoch}",
           f"trainer.seed={a['train.seed']}", f"trainer.output_dir={save.parent}",
           f"trainer.experiment_name={save.name}",
           f"trainer.checkpoint_dir={Path(a['ckpt.path']).absolute()}",
           f"trainer.save_freq={max(a['ckpt.save_steps'], 0)}", f"trainer.max_checkpoints={max(a['ckpt.max_num'], 1)}",
           f"trainer.resume_mode={'auto' if a['ckpt.load_enable'] else 'disable'}", f"trainer.test_freq={test_freq}",
           f"trainer.project_name={a['logger.wandb.project']}", "trainer.progress_bar=false",
           f"trainer.logger=[console,jsonl{',tensorboard' if tb else ''}{',wandb' if wandb else ''}]",
           f"actor.gradient_checkpointing={str(a['model.gradient_checkpointing_enable']).lower()}",
           f"actor.use_remove_padding={str(a['ds.packing_samples']).lower()}"]
    if tb:  # OpenRLHF: os.path.join(tensorboard_dir, run_name)
        out.append(f"trainer.tensorboard_dir={Path(tb).absolute() / (a['logger.wandb.run_name'] or save.name)}")
    if a["ds.lora.rank"]:
        out += [f"model.lora_rank={a['ds.lora.rank']}", f"model.lora_alpha={a['ds.lora.alpha']}",
                f"model.lora_dropout={a['ds.lora.dropout']}",
                f"model.target_modules={json.dumps(list(a['ds.lora.target_modules']))}"]
    if a["ds.load_in_4bit"]:  # QLoRA: the trained model is the adapter folder, as OpenRLHF saves a PEFT model
        out += ["model.load_in_4bit=true", "model.lora_export=adapter"]
    if gpus:
        dtype = {"bf16": "bfloat16", "fp16": "float16"}[a["ds.param_dtype"]]
        out.append(f"model.dtype={dtype}")
        if a["ds.load_in_4bit"]:  # packed 4-bit weights do not go through DeepSpeed's engine here: DDP trains them
            out.append("trainer.strategy=auto")  # ddp under a launcher, one process alone
        else:
            out += ["trainer.strategy=deepspeed", f"trainer.zero_stage={a['ds.zero_stage']}",
                    f"trainer.offload={str(a['ds.adam_offload']).lower()}"]
    else:
        out.append("trainer.device=cpu")
    return out


def overrides(a: dict, gpus: bool) -> list[str]:
    """The alignrl config keys of these (checked) flags: the model and teacher, the data, the recipe last."""
    per_epoch = steps_per_epoch(a)
    return [f"model.path={a['model.model_name_or_path']}", f"model.ref_path={a['teacher.model_name_or_path']}",
            *data_keys(a), *optimiser_keys(a, a["train.max_epochs"] * per_epoch), *run_keys(a, gpus, per_epoch),
            *RECIPE]


def unused(a: dict, gpus: bool) -> list[str]:
    """The flags given that change nothing here, each group with its reason (named once at start)."""
    groups = [([f for f, _, d in entries if a[f] != d], why) for why, entries in NOT_APPLIED.items()]
    groups.append(([] if gpus else [f for f in ("ds.zero_stage", "ds.adam_offload", "ds.param_dtype")
                                    if a[f] != parser().get_default(f)], "no CUDA"))
    if gpus and a["ds.load_in_4bit"]:
        groups.append(([f for f in ("ds.zero_stage", "ds.adam_offload") if a[f] != parser().get_default(f)],
                       "a 4-bit base trains under DDP, not DeepSpeed"))
    if a["data.apply_chat_template"] and a["data.input_template"]:
        groups.append((["data.input_template"], "--data.apply_chat_template formats the prompts"))
    elif a["data.input_template"] and "{}" not in a["data.input_template"]:
        groups.append((["data.input_template"], "it has no {} for the prompt (OpenRLHF drops it too)"))
    if not a["muon.nesterov"]:
        groups.append((["muon.no_nesterov"], "it applies to --optim muon only"))
    return [f"{' '.join('--' + f for f in flags)} ({why})" for flags, why in groups if flags]


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    import torch

    from alignrl.cli import main as alignrl_main
    from alignrl.compat.openrlhf_ppo_ray import export_model
    from alignrl.errors import UserError

    typed = list(sys.argv[1:] if argv is None else argv)
    a = vars(parser(prog).parse_args(typed))
    gpus = torch.cuda.is_available()
    try:
        check(a)
        keys = overrides(a, gpus)
        cfg = load_config(None, keys)
    except UserError as e:
        print(f"{prog}: error: {in_flag_words(str(e), flag_names(a))}", file=sys.stderr, flush=True)
        return 2
    for line in unused(a, gpus):
        print(f"{prog}: accepted, changing nothing here: {line}", flush=True)
    if a["ckpt.save_steps"] < 1:  # OpenRLHF writes none: the model copied into --ckpt.output_dir comes from it
        print(f"{prog}: note: the last step's checkpoint is kept in --ckpt.path {a['ckpt.path']} (the trained model "
              "in --ckpt.output_dir is copied from it); delete it once the run is done", flush=True)
    key = a["logger.wandb.key"]
    if key and key.lower() not in WANDB_SWITCHES:  # as OpenRLHF's wandb.login(key=...): never in the config
        os.environ["WANDB_API_KEY"] = key
    with speaking_as(prog, flag_names(a)):
        code = alignrl_main(["train", "ppo", *keys])
    if code == 0 and os.environ.get("RANK", "0") == "0":  # under a launcher's ranks (deepspeed --module), rank 0
        export_model(cfg.run_dir, cfg.checkpoint_root, cfg.trainer.total_training_steps, prog)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python -m alignrl.compat.openrlhf_opd"))
