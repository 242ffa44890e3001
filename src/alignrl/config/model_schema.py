"""The policy model section of the run configuration (`model.*`): its folder, dtype, LoRA adapters and 4-bit base.
This module imports without torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from alignrl.config.option import opt

# the dtypes bitsandbytes packs 4-bit codes in (transformers' BitsAndBytesConfig accepts these names)
STORAGE_DTYPES = ("uint8", "int8", "float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class ModelConfig:
    path: str = opt("demo", "HF model folder, or 'demo' for the embedded tiny Qwen2 model (built or taken from cache)")
    ref_path: str = opt("", "the reference model's own HF folder (KL loss, KL in reward; a teacher for on-policy "
                            "distillation; ppo-ray's --ref_pretrain); empty: model.path")
    dtype: str = opt("float32", "parameter dtype for training and rollout (bfloat16/float16: single, DDP and FSDP2 "
                               "step fp32 master weights; DeepSpeed: its bf16 mode for bfloat16); use float32 on CPU",
                     choices=("float32", "bfloat16", "float16"))
    lora_rank: int = opt(0, "LoRA adapters of this rank train in place of the policy's (and critic's) weights; the "
                            "reference is the base with adapters off (model.ref_path's model when set); 0 trains all "
                            "weights (verl's model.lora_rank, OpenRLHF's --lora_rank)", ge=0)
    lora_alpha: int = opt(16, "LoRA scale numerator: updates are scaled by lora_alpha / lora_rank", ge=1)
    lora_dropout: float = opt(0.0, "dropout on the LoRA path", ge=0.0, le=1.0)
    target_modules: Any = opt("all-linear", "modules that get adapters: all-linear (every linear layer but the "
                                            "output head), a list of module names (q_proj, v_proj, ...), or "
                                            "peft-default (PEFT's choice for the architecture: q_proj, v_proj for "
                                            "Llama and Qwen, query_key_value for GPT-NeoX)")
    lora_export: str = opt("merged", "the final model of a LoRA run: merged (adapters folded into a plain HF "
                                     "folder) or adapter (the PEFT adapter folder only)",
                           choices=("merged", "adapter"))
    load_in_4bit: bool = opt(False, "QLoRA: the frozen bases of the policy and the critics load quantized to 4 bits "
                                    "(bitsandbytes, model.bnb_4bit_quant_type codes, matmuls in model.dtype) and only "
                                    "their LoRA adapters (and a critic's value head) train; needs model.lora_rank > 0 "
                                    "and model.lora_export=adapter, trainer.strategy single or ddp (OpenRLHF's and "
                                    "TRL's --load_in_4bit; `pip install 'alignrl[qlora]'`)")
    bnb_4bit_quant_type: str = opt("nf4", "the 4-bit codes of model.load_in_4bit: nf4 (NormalFloat, QLoRA's) or fp4 "
                                          "(TRL's --bnb_4bit_quant_type)", choices=("nf4", "fp4"))
    bnb_4bit_use_double_quant: bool = opt(True, "with model.load_in_4bit, quantize the blocks' scales again (about "
                                                "0.4 bits a weight saved; OpenRLHF's setting, TRL's "
                                                "--use_bnb_nested_quant, off by default there)")
    bnb_4bit_quant_storage: str = opt("uint8", "the dtype model.load_in_4bit packs its 4-bit codes in (two codes a "
                                               "byte): the same codes and results in any of them (TRL's "
                                               "--bnb_4bit_quant_storage; FSDP-QLoRA recipes give the model's dtype "
                                               "for FSDP's flat buffers, and 4-bit runs here are single or ddp)",
                                      choices=STORAGE_DTYPES)
