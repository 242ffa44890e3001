"""Run under torchrun (or alone for the one-process reference): one actor update of a fixed global
batch on a chosen training engine, then the full weights to `--out` (rank 0).

    --mode step       one optimisation step per `--layouts` entry, each on a fresh engine, full weights
                      saved as weights_<layout>.safetensors
    --mode roundtrip  step, save HF folder + resumable state, rebuild from them, check they match
    --mode kill       rank 1 dies before a collective: the run must exit non-zero, not hang
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from alignrl.data.records import Experience
from alignrl.dist.env import barrier, init_distributed, shard, shutdown
from alignrl.models.logprobs import Layout, response_logprobs
from alignrl.train.actor import Actor, PolicyLossSpec
from alignrl.train.engines import OptimSpec, build_engine

GLOBAL_BATCH, PROMPT, RESPONSE = 8, 5, 6
LAYOUTS = {"plain": Layout(), "shared": Layout(True, False), "packed": Layout(True, True)}


def fixed_batch(model, shared: bool = False) -> Experience:
    """A deterministic global batch with ragged prompts/responses and old log-probs near the current
    ones, so some tokens clip and some do not. `shared`: rows 0-3 carry one prompt and rows 4-7 another
    (as GRPO's samples do), so each micro-batch of a shared-prompt update holds one prompt twice."""
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt_ids = torch.randint(3, vocab, (GLOBAL_BATCH, PROMPT), generator=g)
    response_ids = torch.randint(3, vocab, (GLOBAL_BATCH, RESPONSE), generator=g)
    p_len = torch.randint(2, PROMPT + 1, (GLOBAL_BATCH,), generator=g)
    if shared:
        prompt_ids, p_len = prompt_ids[torch.arange(GLOBAL_BATCH) // 4], p_len[torch.arange(GLOBAL_BATCH) // 4]
    r_len = torch.randint(1, RESPONSE + 1, (GLOBAL_BATCH,), generator=g)
    prompt_mask = torch.arange(PROMPT)[None] >= (PROMPT - p_len)[:, None]  # left-padded
    response_mask = torch.arange(RESPONSE)[None] < r_len[:, None]  # right-padded
    with torch.no_grad():
        lp, _ = response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask)
    old = (lp + 0.3 * torch.randn(lp.shape, generator=g)) * response_mask
    adv = torch.randn(GLOBAL_BATCH, generator=g)[:, None].expand(-1, RESPONSE) * response_mask
    return Experience(prompt_ids, prompt_mask, response_ids, response_mask, old, None, adv.contiguous())


def local_share(exp: Experience, env) -> Experience:
    return exp.select(torch.tensor(shard(list(range(GLOBAL_BATCH)), env)))


def make_engine(args, env, path, shared: bool = False):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    exp = fixed_batch(model, shared)
    # Adam's first step is lr·g/(|g|+eps): with the default eps a gradient element near 1e-8 turns a
    # last-bit difference in reduction order into an lr-sized one. A larger eps keeps the comparison
    # about the gradients the backends computed, not about float summation order.
    spec = OptimSpec(lr=1e-2, weight_decay=0.01, total_steps=10, grad_clip=1.0, eps=1e-4)
    engine = build_engine(args.strategy, model, spec, env, zero_stage=args.zero_stage,
                          offload=getattr(args, "offload", False))
    return engine, exp


def update(engine, exp, env, layout: Layout = Layout()) -> None:
    Actor(engine, layout).update(local_share(exp, env), PolicyLossSpec(clip_low=0.2, clip_high=0.28, kl_coef=0.0),
                         mini_batch=GLOBAL_BATCH // env.world_size, micro_batch=2, epochs=1,
                         generator=torch.Generator().manual_seed(1))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", required=True)
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--offload", action="store_true", help="DeepSpeed: optimizer state on the CPU")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", default="step", choices=["step", "roundtrip", "kill"])
    p.add_argument("--layouts", default="plain",
                   help="comma-separated, each a step of its own (--mode step): plain, shared (shared-prompt batch "
                        "and forward) or packed (shared and padding-free)")
    args = p.parse_args()
    torch.set_num_threads(1)
    env = init_distributed(timeout_s=float(os.environ.get("ALIGNRL_DIST_TIMEOUT", "60")))
    out = Path(args.out)
    if args.mode == "step":  # several steps in one launch: a torchrun's start-up costs more than a step
        for name in args.layouts.split(","):
            engine, exp = make_engine(args, env, args.model, LAYOUTS[name].share_prompt)
            update(engine, exp, env, LAYOUTS[name])
            save_weights(engine.full_state_dict(), env, out, f"weights_{name}.safetensors")
        shutdown()
        return 0
    engine, exp = make_engine(args, env, args.model)
    if args.mode == "kill":
        if env.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10.0)  # torchrun (polling every 0.1 s) stops this rank first: SIGTERM ends the sleep
    update(engine, exp, env)
    full = engine.full_state_dict()
    if args.mode == "roundtrip":
        folder = out / "ckpt"
        if env.is_main:
            (folder / "model").mkdir(parents=True, exist_ok=True)
            engine.model.save_pretrained(folder / "model", state_dict=full)
        barrier(env)
        engine.save_state(folder)
        barrier(env)
        engine2, _ = make_engine(args, env, str(folder / "model"))
        assert engine2.load_state(folder), "saved training state not found"
        again = engine2.full_state_dict()
        for k, v in full.items():
            assert torch.equal(v, again[k]), f"{k} changed in the round trip"
        # the restored optimizer continues exactly like the original one
        update(engine, exp, env)
        update(engine2, exp, env)
        a, b = engine.full_state_dict(), engine2.full_state_dict()
        for k, v in a.items():
            torch.testing.assert_close(v, b[k], atol=1e-6, rtol=0, msg=f"{k} diverged after resume")
    save_weights(full, env, out, "weights.safetensors")
    shutdown()
    return 0


def save_weights(full: dict, env, out: Path, name: str) -> None:
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.clone().contiguous() for k, v in full.items()}, str(out / name))
    barrier(env)


if __name__ == "__main__":
    sys.exit(main())
