"""Run under torchrun (or alone for the one-process reference): one actor update of a fixed global batch on a policy
with LoRA adapters (and, with --freeze, a frozen prefix) on each engine named, then (rank 0) the merged weights,
the trained tensors and the number of tensors the optimizer holds, to `--out`.

    --engines STRATEGY[:ZERO_STAGE] ...   e.g. single ddp fsdp2 deepspeed:2 deepspeed:3
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
import engine_worker  # noqa: E402

from alignrl.models import lora  # noqa: E402
from alignrl.runtime.env import barrier, init_distributed, shutdown  # noqa: E402
from alignrl.train.engines import OptimSpec, build_engine  # noqa: E402


def make(strategy: str, stage: int, env, path: str, freeze: str | None):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    exp = engine_worker.fixed_batch(model)
    torch.manual_seed(0)
    model = lora.add_adapters(model, lora.lora_spec(4, 8))
    with torch.no_grad():  # B starts at zero in PEFT: a step from there leaves A's gradient zero; move it a little
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.02)
    if freeze:
        lora.freeze_prefixes(model, [freeze])
    spec = OptimSpec(lr=1e-2, weight_decay=0.01, total_steps=10, grad_clip=1.0, eps=1e-4)
    return build_engine(strategy, model, spec, env, zero_stage=stage), exp


def optimizer_elements(engine, env) -> int:
    """The elements of the tensors the optimizer steps, summed over ranks (DDP: a full copy on each; FSDP2: its
    shards; ZeRO: its flat partitions, padded)."""
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)  # DeepSpeed's ZeRO optimizers wrap the client's
    flat = getattr(opt, "fp32_partitioned_groups_flat", None)  # ZeRO-3 keeps its fp32 partitions there
    local = sum(t.numel() for t in flat) if flat else sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() for g in inner.param_groups for p in g["params"])
    total = torch.tensor([float(local)])
    if env.distributed:
        torch.distributed.all_reduce(total)
    return int(total.item())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--engines", nargs="*", default=[])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--freeze", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    env = init_distributed(timeout_s=float(os.environ.get("ALIGNRL_DIST_TIMEOUT", "60")))
    out = Path(args.out)
    for spec in args.engines:
        strategy, _, stage = spec.partition(":")
        engine, exp = make(strategy, int(stage or 0), env, args.model, args.freeze)
        engine_worker.update(engine, exp, env)
        full = engine.full_state_dict(main_only=True)
        elements = optimizer_elements(engine, env)
        if env.is_main:
            out.mkdir(parents=True, exist_ok=True)
            merged = lora.merge_state(full, lora._lora_layers(engine.model))
            save_file({k: v.clone().contiguous() for k, v in merged.items()}, str(out / f"merged_{spec}.safetensors"))
            trainable = sum(v.numel() for k, v in full.items() if k in set(lora.trainable_names(engine.model)))
            (out / f"optim_{spec}.json").write_text(json.dumps(
                {"optimizer_elements": elements, "trainable_elements": trainable,
                 "all_elements": sum(v.numel() for v in full.values()), "world": env.world_size}))
        barrier(env)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
