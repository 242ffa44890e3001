"""The config section of PPO-ptx (Ouyang et al. 2022; OpenRLHF's --pretrain_data, --ptx_coef): pretraining texts
whose language-model loss joins the actor's updates (docs/algorithms.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from alignrl.config.option import opt


@dataclass(frozen=True)
class PtxConfig:
    # str or list, as data.train_files
    data: Any = opt("", "pretraining texts (.jsonl/.json/.parquet, or a list of them) whose language-model loss "
                        "joins the actor's updates (PPO-ptx; OpenRLHF's --pretrain_data); \"\": off")
    data_probs: list = opt([], "with a list of ptx.data: each file's weight in the blend (OpenRLHF's "
                               "--pretrain_data_probs); []: the files concatenated")
    key: str = opt("text", "the column of the texts (OpenRLHF reads its --input_key)")
    coef: float = opt(0.05, "weight of the texts' loss (OpenRLHF's --ptx_coef)", ge=0.0)
    max_length: int = opt(0, "tokens kept of a text (its first); 0: data.max_prompt_length + rollout.max_new_tokens "
                             "(OpenRLHF's prompt_max_len + generate_max_len)", ge=0)
    micro_batch_size: int = opt(0, "texts after each of the update's micro-batches; 0: actor.ppo_micro_batch_size "
                                   "(OpenRLHF's --micro_train_batch_size)", ge=0)


def ptx_problem(cfg) -> str | None:
    """One line on what cannot work in `cfg.ptx` (a RunConfig's), checked before any model loads; None: fine."""
    p = cfg.ptx
    if not p.data:
        return None
    files = [p.data] if isinstance(p.data, str) else list(p.data)
    if not files or not all(isinstance(f, str) and f for f in files):
        return f"ptx.data={p.data!r} must be a file, or a list of files"
    if not p.data_probs:
        return None
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
                  for x in p.data_probs)
    if not numbers or len(p.data_probs) != len(files) or len(files) < 2:
        return (f"ptx.data_probs={p.data_probs!r} must be one finite weight above 0 per ptx.data file "
                f"({len(files)} given; weights blend two files or more), e.g. [0.7,0.3]")
    return None
