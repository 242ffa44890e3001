"""The config section of PPO-ptx (Ouyang et al. 2022; OpenRLHF's --pretrain_data, --ptx_coef): pretraining texts
whose language-model loss joins the actor's updates (docs/algorithms.md)."""

from __future__ import annotations

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
