"""The keys an offline run with `load_in_4bit` (QLoRA: LoRA adapters over a frozen 4-bit NF4 base) must agree with,
checked when the config is read. The base's linear weights are packed NF4 codes, so only adapters can train, nothing
may read those weights as a matrix (a merged export, a reference moved toward the policy) and nothing may shard them
(bitsandbytes' packed parameters are not FSDP2 or ZeRO shards). Nothing here imports torch."""

from __future__ import annotations

import dataclasses
import importlib.metadata

from alignrl.config import ConfigError

_SHARDING = ("fsdp2", "deepspeed")  # the offline engines that shard the trained model's parameters


def with_4bit_checked(cfg, given: set[str]):
    """`cfg` with its 4-bit setting checked, one line for the first key that cannot go with it; `given`: the keys
    the line, its config file or its flags set. With load_in_4bit the saved folder is the adapter folder: lora_export
    defaults to adapter, and merged given is refused."""
    if not getattr(cfg, "load_in_4bit", False):
        return cfg
    if type(cfg).__name__ == "RMConfig":
        raise ConfigError("load_in_4bit=true: `alignrl train rm` loads a sequence classifier whose score head is "
                          "trained in full, which is not loaded in 4-bit; train the reward model with "
                          "load_in_4bit=false (use_lora=true keeps its memory low)")
    if not cfg.use_lora:
        raise ConfigError("load_in_4bit=true quantizes the frozen base under LoRA adapters (QLoRA), and trains "
                          "nothing without them: set use_lora=true (TRL: --use_peft; OpenRLHF: --lora_rank 16), or "
                          "load_in_4bit=false to train all weights")
    if cfg.strategy in _SHARDING:
        raise ConfigError(f"strategy={cfg.strategy} shards the weights, and bitsandbytes' 4-bit weights do not "
                          "shard: set strategy=ddp (or single), or load_in_4bit=false")
    if cfg.lora_export == "merged" and "lora_export" in given:
        raise ConfigError("lora_export=merged folds the adapters into the base weights, which with load_in_4bit are "
                          "4-bit codes: set lora_export=adapter (PEFT's adapter folder, which loads onto the "
                          "full-precision base), or load_in_4bit=false")
    if getattr(cfg, "sync_ref_model", False):
        raise ConfigError("sync_ref_model moves the reference toward the policy's merged weights, which a 4-bit base "
                          "cannot give: set sync_ref_model=false or load_in_4bit=false")
    if not _installed("bitsandbytes"):
        raise ConfigError("load_in_4bit: 4-bit loading needs the bitsandbytes package, which is not installed; "
                          "`pip install 'alignrl[qlora]'` (or load the model unquantized: load_in_4bit=false)")
    return dataclasses.replace(cfg, lora_export="adapter")


def _installed(package: str) -> bool:
    """Whether `package` is installed, by its distribution's metadata (importing it would load torch's compiler
    stack; find_spec answers None while models.quantized keeps it out of a process that trains full weights)."""
    try:
        importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
