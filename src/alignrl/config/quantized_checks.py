"""The keys a 4-bit (QLoRA) run must agree with: `model.load_in_4bit` freezes a base whose linear weights are packed
NF4 codes, so only adapters can train, and nothing may read those weights as a matrix (merged exports, weight
pushes to other processes) or shard them (bitsandbytes' packed parameters are not FSDP2 or ZeRO shards)."""

from __future__ import annotations

from alignrl.config.schema import RunConfig

# the engines whose step shards the policy's parameters over the ranks
_SHARDING = ("fsdp2", "fsdp", "deepspeed")


def quantized_problem(cfg: RunConfig) -> str | None:
    """One line for the first key that cannot go with model.load_in_4bit=true, or None."""
    m = cfg.model
    if not m.load_in_4bit:
        return None
    if m.lora_rank <= 0:
        return ("model.load_in_4bit=true freezes a 4-bit base and trains LoRA adapters on it (QLoRA): set "
                "model.lora_rank > 0 (e.g. 16), or model.load_in_4bit=false to train all weights")
    if cfg.trainer.strategy in _SHARDING:
        return (f"trainer.strategy={cfg.trainer.strategy} shards the weights, and bitsandbytes' 4-bit weights do not "
                "shard: set trainer.strategy=ddp (or single), or model.load_in_4bit=false")
    if m.lora_export == "merged":
        return ("model.lora_export=merged folds the adapters into the base weights, which with model.load_in_4bit are "
                "4-bit codes: set model.lora_export=adapter (PEFT's adapter folder, which loads onto the "
                "full-precision base)")
    if cfg.services.generation_url:
        return ("services.generation_url receives the policy's merged weights after each update, which a 4-bit base "
                "cannot give: generate in the trainer (services.generation_url='') or set model.load_in_4bit=false")
    if cfg.pipeline.placement != "inline":
        return (f"pipeline.placement={cfg.pipeline.placement} sends the samplers the policy's merged weights, which a "
                "4-bit base cannot give: set pipeline.placement=inline or model.load_in_4bit=false")
    return None
