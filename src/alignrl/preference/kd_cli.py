"""The command line of knowledge distillation (`alignrl train kd`): supervised fine-tuning's config and flags
(`preference.sft_cli`) plus the teacher, and OpenRLHF's `train_kd` and TRL's `GKDConfig` flag spellings read as its
keys.

    alignrl train kd teacher_model_path=models/big train_files=[data/train.jsonl] --output_dir models/kd
    alignrl train kd --pretrain models/small --teacher_model models/big --dataset data/train.jsonl --input_key q \\
        --output_key a --apply_chat_template --kd_coef 0.4 --max_len 2048 --save_path models/kd

Every sft key is a kd key too (rows, packing, LoRA, engines, checkpoints, evaluation), layered the same way:
defaults < `--config` YAML < `key=value` < flags. A line in OpenRLHF's spelling takes train_kd's defaults where it is
silent (one epoch, learning rate 5e-6, ...); one in TRL's spelling GKDConfig's: temperature 0.9 and kd_coef 1 (GKD's
loss is the divergence alone), GKD's beta, 0.5, and its lmbda, 0.5 (the student's own generations for about half of
the optimizer steps, `preference.kd_onpolicy`); GKD's temperature samples the generations, its loss runs at 1.
Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
                              "tokens (OpenRLHF's --kd_coef and default); 0: plain SFT, 1: the teacher alone; a "
                              "step on generated completions (lmbda, seq_kd) trains on the distillation loss alone",
                         ge=0.0, le=1.0)
    temperature: float = opt(1.0, "the sampling temperature of the generations (lmbda > 0, seq_kd), top_k 0 and "
                                  "top_p 1 (TRL's GKD temperature, which samples only: its loss runs at 1)", gt=0.0)
    distil_temperature: float = opt(1.0, "both models' logits divided by it in the distillation loss; 1: none, as "
                                         "OpenRLHF's and TRL's losses", gt=0.0)
    beta: float = opt(0.0, "0: the teacher's cross-entropy against the student (OpenRLHF's; KL(teacher ‖ student) "
                           "up to a constant); above 0: GKD's generalized Jensen-Shannon divergence with this weight "
                           "on the teacher, 1 the reverse KL(student ‖ teacher) (TRL's GKD beta)", ge=0.0, le=1.0)
    lmbda: float = opt(0.0, "the chance that an optimizer step trains on the student's own generations for its "
                            "rows' prompts instead of their completions, drawn once per step (TRL's GKD lmbda; its "
                            "default 0.5 in a line of TRL's spelling); 0: the rows' completions alone",
                       ge=0.0, le=1.0)
    seq_kd: bool = opt(False, "sequence-level KD: the teacher's generations for the rows' prompts train instead of "
                              "their completions (a step lmbda draws still takes the student's; TRL's GKD seq_kd)")
    max_new_tokens: int = opt(128, "the most tokens a generation samples (lmbda > 0, seq_kd; TRL's GKD "
                                   "max_new_tokens)", ge=1)


KD_NAMES = {"teacher_model": "teacher_model_path", "teacher_model_name_or_path": "teacher_model_path"}
# TRL's GKD flag that names what happens here anyway
GKD_ACCEPTED = {"disable_dropout": (("true",), "dropout is off in training here, as TRL's default")}
# GKDConfig's own defaults the shared table (their_defaults) does not hold: taken by a line of TRL's spelling
GKD_DEFAULTS = {"lmbda": 0.5}
# the keys the last line parsed took from GKD_DEFAULTS: a refusal names the default, not a value never written
FROM_GKD_DEFAULTS: set[str] = set()


def kd_flags(argv: list[str]) -> CommandFlags:
    """sft's flag table for this line (`sft_cli.sft_flags`) with the teacher's names and GKD's settings."""
    sft = sft_flags(argv)
    return CommandFlags({**sft.names, **KD_NAMES}, sft.switches, sft.left_out,
                        ignored=("teacher_offload",), accepted=GKD_ACCEPTED)


def parse_kd(argv: list[str]) -> KDConfig:
    p = make_parser("alignrl train kd", "Knowledge distillation: supervised fine-tuning of a student on rows, its "
                                        "loss mixed with a frozen teacher's token distributions.")
    p.epilog = (epilog(kd_flags([])) + " --teacher_offload changes nothing (the teacher is a frozen copy on each "
                "rank's device). TRL's --lmbda (default 0.5 in its spelling, 0 in ours) is the chance that an "
                "optimizer step trains on the student's own generations for the rows' prompts, --seq_kd trains on "
                "the teacher's, --temperature samples them (the loss's is distil_temperature), --max_new_tokens caps "
                "them; a step on generations trains on the distillation loss alone (GKD's); generating is refused "
                "with packing, kd_coef=0, images, and rows with no prompt. The sft switches "
                "(--packing_samples, --pretrain_mode, --multiturn) as `alignrl train sft --help` says. Keys and the "
                "loss: docs/kd.md")
    rest, packing = packing_switches(argv)
    args = p.parse_intermixed_args(flags_as_keys(rest + packing, KDConfig, kd_flags(rest)))
    trl = spellings([a[2:].partition("=")[0] for a in rest if a.startswith("--")]) == {TRL}
    # GKD's lmbda under all the line says (its YAML, key=value words and flags)
    cfg = load_flat_config(KDConfig, args.config, args.overrides, {"output_dir": args.output_dir,
                                                                     "logging_dir": args.logging_dir},
                           GKD_DEFAULTS if trl else None)
    if not cfg.train_files:
        raise ConfigError(f"train_files is empty: give the training rows, {dataset_hint(rest, kd_flags(rest))}")
    given = {k for k in ("lmbda", "temperature") if _line_gives(k, rest, args.config)}
    FROM_GKD_DEFAULTS.clear()
    FROM_GKD_DEFAULTS.update(k for k in GKD_DEFAULTS if trl and k not in given)
    if "lmbda" in FROM_GKD_DEFAULTS:
        say(f"note: GKD's lmbda {cfg.lmbda:g} where the line is silent: each optimizer step trains on the student's "
            f"own generations (temperature {cfg.temperature:g}, at most {cfg.max_new_tokens} new tokens) with "
            "chance 0.5, drawn once per step")
    if not cfg.teacher_model_path:
        raise ConfigError("teacher_model_path is empty: give the teacher model's folder (teacher_model_path=DIR; "
                          "OpenRLHF: --teacher_model, TRL: --teacher_model_name_or_path)")
    check_generation(cfg, "temperature" in given)
    return cfg


def _line_gives(key: str, rest: list[str], config: str | None) -> bool:
    """Whether the line itself sets `key` (its flag, a key=value word, its --config YAML), not a default."""
    if any(a.partition("=")[0] in (f"--{key}", key) for a in rest):
        return True
    if not config:
        return False
    import yaml

    read = yaml.safe_load(Path(config).read_text())  # load_flat_config has read it already: it parses
    return isinstance(read, dict) and key in read


def generates(cfg: KDConfig) -> bool:
    """Whether some optimizer steps train on generations (the student's or the teacher's)."""
    return cfg.lmbda > 0 or cfg.seq_kd


def asked(cfg: KDConfig) -> str:
    """What makes the run generate, as its refusals name it: TRL's default lmbda is said to be one."""
    if cfg.lmbda > 0:
        if "lmbda" in FROM_GKD_DEFAULTS and cfg.lmbda == GKD_DEFAULTS["lmbda"]:
            return f"GKD's default lmbda {cfg.lmbda:g} (TRL's spelling)"
        return f"lmbda={cfg.lmbda:g}"
    return "seq_kd=true"


def check_generation(cfg: KDConfig, temperature_given: bool = False) -> None:
    """Generating needs rows laid out one per sequence and the teacher in the loss: packing and kd_coef=0 are one
    line each (a student sharded by fsdp2 or ZeRO-3 generates with every rank in each forward, `kd_onpolicy`); a
    temperature the line gives with nothing to sample is said."""
    if not generates(cfg):
        if temperature_given and cfg.temperature != 1.0:
            say(f"note: temperature={cfg.temperature:g} samples the generations alone and nothing generates here "
                "(lmbda=0, seq_kd=false); the loss's temperature is distil_temperature")
        return
    why = asked(cfg)
    if cfg.packing:
        raise ConfigError(f"{why}: generated completions replace each row's own, one row per sequence, and "
                          "packing=true lays rows end to end; set packing=false, or lmbda=0 and seq_kd=false")
    if cfg.kd_coef == 0:
        raise ConfigError(f"{why} with kd_coef=0: a step on generated completions trains on the distillation loss "
                          "alone (GKD's), and kd_coef=0 leaves the teacher out of every other step; set kd_coef "
                          "above 0 (1: GKD's loss on every step), or lmbda=0 and seq_kd=false for plain SFT")


COMMANDS["kd"] = (parse_kd, "alignrl.preference.kd", "train_kd")


def kd_main(argv: list[str] | None = None) -> int:
    return run_cli(argv, "kd")
