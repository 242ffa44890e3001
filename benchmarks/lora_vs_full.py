#!/usr/bin/env python
"""Full fine-tuning vs LoRA adapters on the policy, on the same model and batch: trainable parameters, optimizer-state
bytes, peak resident memory, and seconds per RL step (generation on the trained module itself, as the in-process
placement does, then one actor update).

    python benchmarks/lora_vs_full.py [--model demo] [--rank 16] [--prompts 8] [--n 4] [--tokens 32] [--steps 3]

Each setting runs in a subprocess of its own, so each peak RSS is that setting's alone (the parent holds nothing).
The first step is warm-up; s/step is the median of the others. Prints each setting's numbers and `ratio full/lora`.
With LoRA the KL reference is the policy with its adapters off, so the full setting counts the reference copy it
would hold (`--with-ref`, on by default) to compare like with like.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch


def run_one(args) -> dict:
    from alignrl.data.records import Experience
    from alignrl.interfaces import SamplingParams
    from alignrl.models import lora
    from alignrl.models.loader import frozen_copy, load_model
    from alignrl.rl.producer import batched_logprobs
    from alignrl.rollout.hf_engine import HFRolloutEngine
    from alignrl.runtime.env import SINGLE
    from alignrl.train.actor import Actor, PolicyLossSpec
    from alignrl.train.engines import OptimSpec, build_engine

    torch.manual_seed(0)
    model, tokenizer = load_model(args.model, "float32")
    ref = frozen_copy(model) if args.rank == 0 and args.with_ref else None  # LoRA's reference: adapters off
    if args.rank:
        model = lora.add_adapters(model, lora.lora_spec(args.rank, 2 * args.rank))
    engine = build_engine("single", model, OptimSpec(lr=1e-5), SINGLE)
    actor = Actor(engine)
    gen = HFRolloutEngine(actor.model, tokenizer)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size, (16,), generator=g).tolist() for _ in range(args.prompts)]
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        ro = gen.generate(prompts, SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.tokens, seed=step))
        old = batched_logprobs(actor.model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, 1.0, 16)
        with lora.adapters_off(actor.model):  # the reference pass: the base (a copy of it without LoRA)
            refp = batched_logprobs(ref if ref is not None else actor.model, ro.prompt_ids, ro.prompt_mask,
                                    ro.response_ids, ro.response_mask, 1.0, 16)
        adv = torch.randn(len(ro.response_ids), generator=g)[:, None].expand_as(old) * ro.response_mask
        exp = Experience(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, old, refp,
                         adv.contiguous())
        actor.update(exp, PolicyLossSpec(kl_coef=0.01), mini_batch=len(old), micro_batch=8, epochs=1,
                     generator=torch.Generator().manual_seed(step))
        times.append(time.perf_counter() - t0)
    state_bytes = sum(t.numel() * t.element_size() for s in engine.optimizer.state.values() for t in s.values()
                      if torch.is_tensor(t))
    return {"trainable": sum(p.numel() for p in actor.model.parameters() if p.requires_grad),
            "total": sum(p.numel() for p in actor.model.parameters()), "optimizer_bytes": state_bytes,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "s_per_step": statistics.median(times[1:] or times)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--model", default="demo")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--with-ref", type=int, default=1)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the subprocess: one setting
    args = p.parse_args()
    if args.one:
        torch.set_num_threads(1)
        print(json.dumps(run_one(args)))
        return 0
    out = {}
    for name, rank in (("full", 0), ("lora", args.rank)):
        argv = [sys.executable, __file__, "--one", "--model", args.model, "--rank", str(rank), "--prompts",
                str(args.prompts), "--n", str(args.n), "--tokens", str(args.tokens), "--steps", str(args.steps),
                "--with-ref", str(args.with_ref)]
        done = subprocess.run(argv, capture_output=True, text=True, check=True)
        out[name] = json.loads(done.stdout.strip().splitlines()[-1])
        r = out[name]
        print(f"{name:5s} trainable {r['trainable']:>9,} of {r['total']:,} params  optimizer state "
              f"{r['optimizer_bytes'] / 2**20:8.3f} MiB  peak RSS {r['peak_rss_mb']:7.1f} MiB  "
              f"{r['s_per_step']:.3f} s/step")
    f, lo = out["full"], out["lora"]
    print(f"ratio full/lora: trainable {f['trainable'] / lo['trainable']:.1f}x, optimizer state "
          f"{f['optimizer_bytes'] / lo['optimizer_bytes']:.1f}x, peak RSS {f['peak_rss_mb'] / lo['peak_rss_mb']:.2f}x, "
          f"s/step {f['s_per_step'] / lo['s_per_step']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
