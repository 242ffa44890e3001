"""Run under torchrun (or alone for the one-process reference): actor updates of a fixed global batch on
chosen training engines, then the full weights to `--out` (rank 0).

    --engines SPEC ...  each SPEC `strategy:zero_stage[:offload]=layout,...`: one optimisation step per layout
                        (plain, shared, packed), each on a fresh engine, full weights saved as
                        weights_<tag>_<layout>.safetensors (tag: strategy, stage, "o" if offloaded); the layout
                        `roundtrip` steps, saves an HF folder + resumable state to ckpt_<tag>, rebuilds from them
                        and checks that the restored engine matches and continues like the original
    --kill STRATEGY     rank 1 dies before a collective: the run must exit non-zero, not hang

Several engines share one launch: a torchrun's start-up (torch, transformers) costs more than their steps.
"""

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from alignrl.data.records import Experience
from alignrl.runtime.env import barrier, init_distributed, shard, shutdown
from alignrl.models.logprobs import ForwardLayout, response_logprobs
from alignrl.train.actor import Actor, PolicyLossSpec
from alignrl.train.checkpoint import save_engine
from alignrl.train.engines import OptimSpec, build_engine

GLOBAL_BATCH, PROMPT, RESPONSE = 8, 5, 6
LAYOUTS = {"plain": ForwardLayout(), "shared": ForwardLayout(True, False), "packed": ForwardLayout(True, True)}


@dataclass(frozen=True)
class EngineArgs:
    strategy: str
    zero_stage: int = 2
    offload: bool = False
    bf16: bool = False  # the model in bf16: the engine steps fp32 master weights

    @property
    def tag(self) -> str:
        return f"{self.strategy}{self.zero_stage}{'o' if self.offload else ''}{'b' if self.bf16 else ''}"


def parse_spec(spec: str) -> tuple[EngineArgs, list[str]]:
    """`deepspeed:3:offload=plain,roundtrip` -> (EngineArgs("deepspeed", 3, True), ["plain", "roundtrip"]);
    `fsdp2:0:bf16=roundtrip`: the model in bf16."""
    engine, layouts = spec.split("=")
    strategy, stage, *rest = engine.split(":")
    if rest not in ([], ["offload"], ["bf16"]):
        raise ValueError(f"{spec!r}: after the stage only ':offload' or ':bf16' may follow")
    return EngineArgs(strategy, int(stage), rest == ["offload"], rest == ["bf16"]), layouts.split(",")


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
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if args.bf16 else torch.float32)
    model.config.use_cache = False
    exp = fixed_batch(model, shared)
    # Adam's first step is lr·g/(|g|+eps): with the default eps a gradient element near 1e-8 turns a
    # last-bit difference in reduction order into an lr-sized one. A larger eps keeps the comparison
    # about the gradients the backends computed, not about float summation order.
    spec = OptimSpec(lr=1e-2, weight_decay=0.01, total_steps=10, grad_clip=1.0, eps=1e-4)
    engine = build_engine(args.strategy, model, spec, env, zero_stage=args.zero_stage,
                          offload=args.offload)
    return engine, exp


def update(engine, exp, env, layout: ForwardLayout = ForwardLayout()) -> None:
    Actor(engine, layout).update(local_share(exp, env), PolicyLossSpec(clip_low=0.2, clip_high=0.28, kl_coef=0.0),
                         mini_batch=GLOBAL_BATCH // env.world_size, micro_batch=2, epochs=1,
                         generator=torch.Generator().manual_seed(1))


def count_reductions(engine) -> list[int] | None:
    """The DDP buckets all-reduced during the step, in order (DDP's default hook, counted); None if not DDP."""
    from torch.nn.parallel import DistributedDataParallel
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    if not isinstance(engine.module, DistributedDataParallel):
        return None
    seen: list[int] = []

    def hook(state, bucket):
        seen.append(bucket.index())
        return allreduce_hook(state, bucket)

    engine.module.register_comm_hook(None, hook)
    return seen


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--engines", nargs="*", default=[], help="strategy:zero_stage[:offload]=layout,...")
    p.add_argument("--kill", metavar="STRATEGY", help="rank 1 dies before the first collective")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    env = init_distributed(timeout_s=float(os.environ.get("ALIGNRL_DIST_TIMEOUT", "60")))
    out = Path(args.out)
    if args.kill:
        engine, exp = make_engine(EngineArgs(args.kill), env, args.model)
        if env.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10.0)  # torchrun (polling every 0.1 s) stops this rank first: SIGTERM ends the sleep
        update(engine, exp, env)  # never reached; if it were, its all-reduce would have no peer
        save_weights(engine.full_state_dict(), env, out, "weights.safetensors")
    for spec in args.engines:
        engine_args, layouts = parse_spec(spec)
        for name in layouts:
            if name == "roundtrip":
                roundtrip(engine_args, env, args.model, out / f"ckpt_{engine_args.tag}")
                continue
            engine, exp = make_engine(engine_args, env, args.model, LAYOUTS[name].share_prompt)
            reduced = count_reductions(engine)
            update(engine, exp, env, LAYOUTS[name])
            save_weights(engine.full_state_dict(), env, out, f"weights_{engine_args.tag}_{name}.safetensors")
            if reduced is not None and env.is_main:
                (out / f"reductions_{engine_args.tag}_{name}.json").write_text(json.dumps(reduced))
    shutdown()
    return 0


def roundtrip(engine_args: EngineArgs, env, model: str, folder: Path) -> None:
    """A step, the full weights and resumable state saved, an engine rebuilt from them: equal weights, and
    the restored optimizer continues exactly like the original one."""
    engine, exp = make_engine(engine_args, env, model)
    update(engine, exp, env)
    full = engine.full_state_dict()
    folder.mkdir(parents=True, exist_ok=True)
    save_engine(engine, folder, "model", env)  # as a checkpoint saves it: folder/model, folder/model_state
    barrier(env)
    if engine_args.bf16:  # published and saved in the model's dtype, whatever the engine steps
        got = ({v.dtype for v in full.values()}, set(engine.weight_dtypes().values()))
        assert got == ({torch.bfloat16}, {torch.bfloat16}), (engine_args.tag, got)
        assert json.loads((folder / "model" / "config.json").read_text())["dtype"] == "bfloat16"
    engine2, _ = make_engine(engine_args, env, str(folder / "model"))
    assert engine2.load_state(folder / "model_state"), "saved training state not found"
    again = engine2.full_state_dict()
    for k, v in full.items():
        assert torch.equal(v, again[k]), f"{engine_args.tag}: {k} changed in the round trip"
    update(engine, exp, env)
    update(engine2, exp, env)
    a, b = engine.full_state_dict(), engine2.full_state_dict()
    for k, v in a.items():
        torch.testing.assert_close(v, b[k], atol=1e-6, rtol=0, msg=f"{engine_args.tag}: {k} diverged after resume")


def save_weights(full: dict, env, out: Path, name: str) -> None:
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.clone().contiguous() for k, v in full.items()}, str(out / name))
    barrier(env)


if __name__ == "__main__":
    sys.exit(main())
