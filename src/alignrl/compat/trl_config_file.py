"""TRL's YAML config file (`trl grpo --config grpo.yaml`, as TRL's and open-r1's recipes are run) on
`alignrl train grpo`: its keys are TRL's flag names, and flags on the line win over it (`runtime.flag_file`). A
`--config` file with alignrl's or verl's sections is left where it is: it is alignrl's own config.

    alignrl train grpo --config recipes/grpo.yaml --learning_rate 1e-6
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alignrl.compat.trl_grpo_flags import TrlFlagError, is_trl_line
from alignrl.runtime import flag_file

# alignrl's own top-level sections (and verl's): a file holding one is not TRL's
NOT_TRL = ("model", "data", "rollout", "actor", "algorithm", "critic", "safety", "services", "pipeline", "agent",
           "retriever", "sandbox", "ptx", "trainer", "actor_rollout_ref", "reward_model", "custom_reward_function")


def grpo_flag_names(default_none: bool = False, p=None) -> set[str]:
    """TRL's GRPO flag names alignrl reads (or those of the parser `p`); with `default_none`, those whose default is
    None (where a file's null, TRL's None, is the default)."""
    from alignrl.compat.trl_grpo_flags import parser

    return {a.dest for a in (p or parser())._actions if not default_none or a.default is None} - {"help", "config"}


def expand(words: list[str], p=None, whose: str = "TRL's GRPO") -> list[str] | None:
    """The line with its TRL config file's settings as flags before its own; None when it names no TRL file. `p`:
    the parser of another TRL trainer's command (every line of which is TRL's), GRPO's when None."""
    names = grpo_flag_names(p=p)

    def is_trl(settings: dict[str, Any]) -> bool:
        return not any(k in NOT_TRL for k in settings) and any(k in names or k == "env" for k in settings)

    at = flag_file.config_at(words)
    if at is not None and not Path(at[2]).is_file() and (p is not None or is_trl_line(words)):
        raise TrlFlagError(f"--config {at[2]}: no such file (from {Path.cwd()})")
    return flag_file.expand(words, is_trl, names, whose, nullable=grpo_flag_names(default_none=True, p=p))


def run_command(words: list[str], parser, from_line, what: str) -> int:
    """A TRL trainer's command line (`alignrl train online-dpo`, `train rloo`): its flags (or a `--config` YAML of
    them) translated by `from_line`, the start lines said by rank 0, then run as `alignrl train grpo`."""
    import os
    import sys

    from alignrl.cli import main as alignrl_main
    from alignrl.errors import UserError, program
    from alignrl.runtime.one_line import speak_once

    try:
        from_file = expand(words, parser, f"TRL's {what}")
        keys, lines = from_line(words if from_file is None else from_file)
    except UserError as e:
        return speak_once(f"{program()}: error: {e}")
    if os.environ.get("RANK", "0") == "0":
        for line in lines:
            print(f"{program()}: {line}", file=sys.stderr, flush=True)
    return alignrl_main(["train", "grpo", *keys])

