"""The command line of knowledge distillation (`alignrl train kd`): supervised fine-tuning's config and flags
(`preference.sft_cli`) plus the teacher, and OpenRLHF's `train_kd` and TRL's `GKDConfig` flag spellings read as its
keys.

    alignrl train kd teacher_model_path=models/big train_files=[data/train.jsonl] --output_dir models/kd
    alignrl train kd --pretrain models/small --teacher_model models/big --dataset data/train.jsonl --input_key q \\
        --output_key a --apply_chat_template --kd_coef 0.4 --max_len 2048 --save_path models/kd

Every sft key is a kd key too (rows, packing, LoRA, engines, checkpoints, evaluation), layered the same way:
defaults < `--config` YAML < `key=value` < flags. A line in OpenRLHF's spelling takes train_kd's defaults where it is
silent (one epoch, learning rate 5e-6, ...); one in TRL's spelling GKDConfig's: temperature 0.9 and kd_coef 1 (GKD's
loss is the divergence alone) and GKD's beta, 0.5. Of GKD, the on-policy part (`lmbda` > 0, `seq_kd`) is left out:
the student learns the teacher's distributions on the dataset's rows.
Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from alignrl.config import ConfigError, opt
from alignrl.preference.cli import COMMANDS, load_flat_config, make_parser, run_cli
from alignrl.preference.flag_names import CommandFlags, dataset_hint, epilog, flags_as_keys
from alignrl.preference.notes import say
from alignrl.preference.sft_cli import SFTConfig, packing_switches, sft_flags
from alignrl.preference.their_defaults import TRL, spellings


@dataclass(frozen=True)
class KDConfig(SFTConfig):
    teacher_model_path: str = opt("", "the teacher: a causal LM folder sharing the student's tokenizer, loaded frozen "
                                      "beside it (OpenRLHF: --teacher_model; TRL: --teacher_model_name_or_path)")
    teacher_dtype: str = opt("auto", "the teacher's weights: auto is bfloat16 when the run trains in bf16 (as "
                                     "OpenRLHF loads it under --bf16: half the memory), else float32",
                             choices=("auto", "float32", "bfloat16"))
    kd_coef: float = opt(0.4, "weight of the distillation loss: (1 - kd_coef) × the rows' cross-entropy + kd_coef × "
                              "the teacher's cross-entropy against the student, both token means over the trained "
                              "tokens (OpenRLHF's --kd_coef and default); 0: plain SFT, 1: the teacher alone",
                         ge=0.0, le=1.0)
    temperature: float = opt(1.0, "both models' logits divided by it in the distillation loss (TRL's GKD "
                                  "temperature); 1: none, as OpenRLHF", gt=0.0)
    beta: float = opt(0.0, "0: the teacher's cross-entropy against the student (OpenRLHF's; KL(teacher ‖ student) "
                           "up to a constant); above 0: GKD's generalized Jensen-Shannon divergence with this weight "
                           "on the teacher, 1 the reverse KL(student ‖ teacher) (TRL's GKD beta)", ge=0.0, le=1.0)


KD_NAMES = {"teacher_model": "teacher_model_path", "teacher_model_name_or_path": "teacher_model_path"}
# TRL's GKD flags that name what happens here anyway: the dataset's rows (no student generations), forward KL
GKD_ACCEPTED = {
    "lmbda": (("0", "0.0"), "the student's own generations (GKD's on-policy fraction) are left out; the "
                            "dataset's completions alone train"),
    "seq_kd": (("false",), "sequence-level KD (training on the teacher's generations) is left out"),
    "disable_dropout": (("true",), "dropout is off in training here, as TRL's default"),
}
# GKD's generation settings: nothing generates here
GKD_LEFT_OUT = {"max_new_tokens": "nothing generates here (GKD's on-policy part, lmbda > 0, is left out)"}


def kd_flags(argv: list[str]) -> CommandFlags:
    """sft's flag table for this line (`sft_cli.sft_flags`) with the teacher's names and GKD's settings."""
    sft = sft_flags(argv)
    return CommandFlags({**sft.names, **KD_NAMES}, sft.switches, {**sft.left_out, **GKD_LEFT_OUT},
                        ignored=("teacher_offload",), accepted=GKD_ACCEPTED)




def parse_kd(argv: list[str]) -> KDConfig:
    p = make_parser("alignrl train kd", "Knowledge distillation: supervised fine-tuning of a student on rows, its "
                                        "loss mixed with a frozen teacher's token distributions.")
    p.epilog = (epilog(kd_flags([])) + " --teacher_offload changes nothing (the teacher is a frozen copy on each "
                "rank's device); TRL's --lmbda takes 0 and --seq_kd false only (no generation here). The "
                "sft switches (--packing_samples, --pretrain_mode, --multiturn) as `alignrl train sft --help` says. "
                "Keys and the loss: docs/kd.md")
    rest, packing = packing_switches(argv)
    args = p.parse_intermixed_args(flags_as_keys(rest + packing, KDConfig, kd_flags(rest)))
    cfg = load_flat_config(KDConfig, args.config, args.overrides, {"output_dir": args.output_dir,
                                                                     "logging_dir": args.logging_dir})
    if not cfg.train_files:
        raise ConfigError(f"train_files is empty: give the training rows, {dataset_hint(rest, kd_flags(rest))}")
    if spellings([a[2:].partition("=")[0] for a in rest if a.startswith("--")]) == {TRL} and not any(
            a.startswith("--lmbda") for a in rest):
        say("note: GKD's lmbda 0.5 (the student's own generations for half of the batches) is not taken: the "
            "dataset's completions alone train")
    if not cfg.teacher_model_path:
        raise ConfigError("teacher_model_path is empty: give the teacher model's folder (teacher_model_path=DIR; "
                          "OpenRLHF: --teacher_model, TRL: --teacher_model_name_or_path)")
    return cfg


COMMANDS["kd"] = (parse_kd, "alignrl.preference.kd", "train_kd")


def kd_main(argv: list[str] | None = None) -> int:
    return run_cli(argv, "kd")
