"""Knowledge distillation (`alignrl train kd`): supervised fine-tuning whose loss mixes the rows' cross-entropy with
a frozen teacher's token distributions, as OpenRLHF's `train_kd` trains it.

    alignrl train kd model_path=models/small teacher_model_path=models/big train_files=[data/train.jsonl] \\
        --output_dir models/kd --nproc 2

Everything but the loss is `preference.sft`'s (rows, packing, LoRA, engines, checkpoints, held-out loss and the saved
folder): this module hands `train_sft` an objective. Each micro-batch runs through the student and, with no
gradient, through the teacher (the same ids, the same position ids when packed, the same autocast); at the trained
positions alone, in float32,

    loss = (1 - kd_coef) · gpt_loss + kd_coef · distil_loss

where gpt_loss is the cross-entropy of the rows' next tokens and distil_loss is -Σ_v p_teacher(v) log p_student(v)
(`core.distill`), each a token mean over the optimizer step's trained tokens on all ranks, and logged as
train/gpt_loss and train/distil_loss (OpenRLHF's names) beside train/loss. OpenRLHF's KDLoss masks the teacher's
term by the label at the logit's own position, one token off the cross-entropy's; here both terms read the same
positions, those whose next token trains. The held-out loss is the student's cross-entropy, as OpenRLHF evaluates.
With `lmbda` > 0 or `seq_kd` (TRL's GKD), some steps train on completions the student or the teacher samples for the
rows' prompts instead (`kd_onpolicy`), on distil_loss alone at the sampled tokens, as TRL's GKD loss is its
divergence alone: the rows' cross-entropy would teach the student its own samples (or the teacher's tokens where its
distribution already is); train/gpt_loss is not logged on those steps.

The teacher is frozen (no gradient, no optimizer) and in eval mode, outside the student's engine. Under
strategy=fsdp2, or deepspeed with zero_stage=3, with more than one rank it is sharded over the ranks: FSDP2's
`fully_shard` on each transformer block and the root over all the ranks, each rank reading only its own rows of the
weights where the folder allows (`models.sharded_load`), and resharded after every forward, so between micro-batches
a rank holds 1/N of it, as OpenRLHF's teacher under ZeRO-3. Sharding a frozen module needs only the process group,
not the student's engine, so FSDP2 holds it beside a DeepSpeed student too. Its forwards are then collectives: every
rank runs one per micro-batch, and each rank has as many micro-batches per step (whole global batches; in a packed
dataset's last partial step a micro-batch with no row left runs an untrained filler row); seq_kd's generations run
with every rank in step (`kd_onpolicy`). Under single, ddp and deepspeed's stages 0-2 (which keep whole weights of the
student on each rank too) each rank holds a whole copy on its device. The start line says which, with the teacher's
bytes per rank. The teacher must share the student's tokenizer: a different vocabulary is refused in one line; heads
padded to different sizes beyond the tokenizer (a model family's sizes) are matched, the teacher's extra entries
dropped (`core.distill.match_vocab`), said at start.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from alignrl.config import ConfigError
from alignrl.core.distill import distill_sum, match_vocab, mix
from alignrl.models.sharded_load import held_bytes, size_text
from alignrl.preference import common as pc
from alignrl.preference.kd_cli import KDConfig, generates
from alignrl.preference.kd_onpolicy import OnPolicy
from alignrl.preference.sft import train_sft, trained_logits
from alignrl.preference.sft_packing import check_packable, one_row_attention

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def train_kd(cfg: KDConfig, dry_run_world: int | None = None) -> dict:
    """`train_sft` with the distillation objective, and with lmbda > 0 or seq_kd the generations' loader
    (`kd_onpolicy`); the teacher's folder is checked first (a dry run too)."""
    from alignrl.models.loader import resolve_model_path

    resolve_model_path(cfg.teacher_model_path, lambda *_: None, "teacher_model_path")
    cfg = replace(cfg, output_dir=cfg.output_dir or "models/kd")  # and its logs under logs/training/kd
    on_policy = OnPolicy(cfg) if generates(cfg) else None
    return train_sft(cfg, dry_run_world, objective=partial(distillation, on_policy=on_policy), batches=on_policy,
                     check_rows=on_policy.check if on_policy is not None else None)


def distillation(cfg: KDConfig, model, tok, env, log, notes: dict, on_policy: OnPolicy | None = None):
    """The objective `train_sft` calls once its student is built: the teacher loaded and checked, and
    `summed(module, batch) -> (loss, {"gpt_loss": Σ, "distil_loss": Σ})`, sums over the batch's trained tokens;
    with `on_policy`, also its step's metrics (on_policy, completion_length) as they are, and on a step of generated
    completions the loss is distil_loss alone (no gpt_loss)."""
    teacher = load_teacher(cfg, model, tok, env, log)
    from alignrl.models.vision import is_vision_model

    if notes.get("image_rows") and not is_vision_model(teacher):
        raise ConfigError(f"teacher_model_path={cfg.teacher_model_path}: {notes['image_rows']} rows carry images and "
                          "the teacher is a text-only model: give a vision-language teacher of the student's family")
    vocab = _vocab(model)
    notes.update({"teacher_model_path": cfg.teacher_model_path, "kd_coef": cfg.kd_coef,
                  "distil_temperature": cfg.distil_temperature, "beta": cfg.beta})
    if on_policy is not None:
        on_policy.teacher = teacher  # seq_kd's generations
        on_policy.limit = min(vocab, _vocab(teacher), len(tok))  # an id either model's embedding lacks never samples
        notes.update({"lmbda": cfg.lmbda, "seq_kd": cfg.seq_kd, "temperature": cfg.temperature,
                      "max_new_tokens": cfg.max_new_tokens})

    def summed(module, batch):
        picked, labels = trained_logits(module, batch, cfg, env.device)
        with torch.no_grad():
            taught, _ = trained_logits(teacher, batch, cfg, env.device)
        distil = distill_sum(picked, match_vocab(taught, vocab), cfg.distil_temperature, cfg.beta)
        if on_policy is not None and on_policy.generated:  # GKD's loss on generations: the divergence alone
            return distil, {"distil_loss": distil.detach()}, on_policy.metrics()
        gpt = torch.nn.functional.cross_entropy(picked, labels, reduction="sum")
        sums = {"gpt_loss": gpt.detach(), "distil_loss": distil.detach()}
        if on_policy is None:
            return mix(gpt, distil, cfg.kd_coef), sums
        return mix(gpt, distil, cfg.kd_coef), sums, on_policy.metrics()

    return summed


def load_teacher(cfg: KDConfig, student, tok, env, log):
    """The teacher: in teacher_dtype, frozen, in eval mode (no dropout) on the rank's device, sharded over the ranks
    under fsdp2 and ZeRO-3 (`sharded_teacher`), its vocabulary checked against the student's; with packing, checked to
    keep packed rows apart in the layout the student's batches take."""
    from alignrl.models.loader import load_causal_lm, resolve_model_path

    folder = resolve_model_path(cfg.teacher_model_path, log.print, "teacher_model_path")
    _check_tokenizer(folder, tok, cfg.teacher_model_path)
    dtype = cfg.teacher_dtype if cfg.teacher_dtype != "auto" else ("bfloat16" if pc.use_bf16(cfg) else "float32")
    # sharded wherever the student is (fsdp2, ZeRO-3): FSDP2 shards a frozen module over the process group alone,
    # whatever engine trains the student, so a ZeRO-3 student's teacher needs no DeepSpeed engine of its own
    shards = (cfg.strategy == "fsdp2" or cfg.strategy == "deepspeed" and cfg.zero_stage == 3) and env.world_size > 1
    teacher = sharded_teacher(folder, dtype, env) if shards else load_causal_lm(folder, dtype, "teacher_model_path")
    check_vocab(_vocab(teacher), _vocab(student), len(tok), cfg.teacher_model_path, log)
    teacher.requires_grad_(False)
    teacher.eval()
    if not shards:  # the shards are on the device already
        teacher.to(env.device)
    if cfg.packing and cfg.packing_strategy != "wrapped":  # wrapped rows are padded, their attention crossing rows
        check_packable(teacher, cfg.max_length)  # a sharded teacher's forwards run on every rank alike
        if one_row_attention(teacher) != one_row_attention(student):
            raise ConfigError("packing=true: the teacher's and the student's attention implementations lay packed "
                              "rows out differently (flash attention needs them in one row); load both with the "
                              "same attn_implementation, or set packing=false")
    n = sum(p.numel() for p in teacher.parameters())
    mixed = f"{1 - cfg.kd_coef:g} × gpt_loss + {cfg.kd_coef:g} × distil_loss"
    log.print(f"teacher {cfg.teacher_model_path}: {n / 1e6:.2f}M parameters, frozen, {dtype} on {env.device}; loss = "
              + ("distil_loss (seq_kd: every step trains on generations)" if cfg.seq_kd else mixed
                 + (" (distil_loss alone on steps of the student's generations)" if cfg.lmbda > 0 else ""))
              + (f", temperature {cfg.distil_temperature:g}" if cfg.distil_temperature != 1.0 else "")
              + (f", GKD's generalized JSD with beta {cfg.beta:g}" if cfg.beta else ""))
    held = size_text(held_bytes(teacher))
    beside = " beside the student's ZeRO-3 partitions" if cfg.strategy == "deepspeed" else ""
    log.print(f"teacher: sharded over {env.world_size} ranks (FSDP2){beside}, {held} of its weights per rank, "
              "gathered a block at a time in each forward" if shards else
              f"teacher: a whole copy on each rank, {held} per rank")
    return teacher


def sharded_teacher(folder: Path, dtype: str, env):
    """The teacher sharded over all of `env`'s ranks with FSDP2 (as the fsdp2 engine shards a student, resharded after
    every forward, the root too; beside a ZeRO-3 student as well, FSDP2 needing only the process group), each rank
    reading only its own rows of the weights; a folder that cannot be read by rows (`.bin` weights, a vision-language
    model, a reward model, which `load_causal_lm` refuses) is loaded whole first, then sharded."""
    from alignrl.models.loader import DTYPES, SCORE_INFO, load_causal_lm
    from alignrl.models.sharded_load import load_sharded
    from alignrl.models.vision import is_vision_folder
    from alignrl.train.engines.fsdp2 import shard_blocks

    def shard(model: torch.nn.Module) -> None:
        shard_blocks(model, env, reshard_after_forward=True)  # FSDP2 keeps a root gathered for a backward it never has

    by_rows = not is_vision_folder(folder) and not (Path(folder) / SCORE_INFO).is_file()
    teacher = load_sharded(Path(folder), DTYPES[dtype], env.device, shard) if by_rows else None
    if teacher is None:
        teacher = load_causal_lm(folder, dtype, "teacher_model_path")
        teacher.requires_grad_(False)
        teacher.eval()
        shard(teacher)
    return teacher


def _vocab(model) -> int:
    """The entries of the model's output head (its logits' last size)."""
    return int(model.get_output_embeddings().weight.shape[0])


def check_vocab(teacher: int, student: int, tokens: int, path: str, log) -> None:
    """Heads of one size pass; heads padded to different sizes that both cover the tokenizer's `tokens` are matched
    (said); otherwise the two cannot share the tokenizer: one line naming both sizes."""
    if teacher == student:
        return
    if min(teacher, student) < tokens:
        raise ConfigError(f"teacher_model_path={path}: the teacher's vocabulary has {teacher} entries and the "
                          f"student's {student} (its tokenizer {tokens} tokens): distillation compares the two "
                          "models' next-token distributions entry by entry, so they must share a tokenizer; give a "
                          "teacher of the student's model family")
    what = "its extra entries dropped" if teacher > student else "0 on the student's extra entries"
    log.print(f"note: the teacher's head has {teacher} entries and the student's {student}, both beyond the "
              f"tokenizer's {tokens} tokens (padding): the teacher's distribution is taken over the student's "
              f"{student} entries ({what})")


def _check_tokenizer(folder: Path, tok, path: str) -> None:
    """A teacher folder that holds a tokenizer must hold the student's: the same tokens with the same ids."""
    if not any((Path(folder) / f).is_file() for f in TOKENIZER_FILES):
        return  # a folder of weights alone: its head's size is checked against the student's
    from alignrl.models.loader import load_tokenizer

    theirs = load_tokenizer(Path(folder), chat=False)
    if len(theirs) != len(tok) or theirs.get_vocab() != tok.get_vocab():
        raise ConfigError(f"teacher_model_path={path}: its tokenizer has {len(theirs)} tokens and the student's "
                          f"{len(tok)}{' (with other ids)' if len(theirs) == len(tok) else ''}: distillation "
                          "compares the two models' next-token distributions entry by entry, so they must share a "
                          "tokenizer; give a teacher of the student's model family")
