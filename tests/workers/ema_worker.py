"""Run under torchrun (or called in one process for the reference): three actor updates of engine_worker's fixed
global batch with the policy's moving average (beta 0.9), a checkpoint after steps 2 and 3 (`<out>/<tag>/straight`);
then an engine resumed from step 2's checkpoint takes step 3 again (`<out>/<tag>/resumed`). Each rank counts the
collectives called while the average updates (none expected) and while it is gathered for a checkpoint (some: the
count sees them), written to `<out>/<tag>/collectives_<rank>.json`.

    --engines SPEC ...  engine_worker's `strategy:zero_stage` (fsdp2:0, deepspeed:3)
"""

import argparse
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoTokenizer

from alignrl.runtime.env import init_distributed, shard, shutdown
from alignrl.train.actor import Actor, PolicyLossSpec
from alignrl.train.checkpoint import save_checkpoint
from alignrl.train.ema import PolicyAverage

sys.path.insert(0, str(Path(__file__).parent))
from engine_worker import GLOBAL_BATCH, make_engine, parse_spec  # noqa: E402

BETA = 0.9
COLLECTIVES = ["all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "gather",
               "reduce_scatter_tensor", "all_to_all_single", "send", "recv", "barrier"]


@contextmanager
def counting(counts: dict[str, int], key: str, engine):
    """Counts, under `key`, calls of torch.distributed's collectives, of DTensor's gathers and of the engine's
    full_state_dict made inside the block."""
    patched = [(dist, name) for name in COLLECTIVES] + [(DTensor, "full_tensor"), (DTensor, "redistribute")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patched]
    saved.append((engine, "full_state_dict", engine.full_state_dict))

    def counted(fn):
        def call(*args, **kwargs):
            counts[key] = counts.get(key, 0) + 1
            return fn(*args, **kwargs)
        return call

    counts.setdefault(key, 0)
    for owner, name, fn in saved:
        setattr(owner, name, counted(fn))
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        del engine.full_state_dict  # the instance attribute goes: the class's method again


def step(engine, average: PolicyAverage, exp, env) -> None:
    """One optimizer step (the whole global batch as one mini-batch), which moves the average."""
    rows = torch.tensor(shard(list(range(GLOBAL_BATCH)), env))
    Actor(engine, average=average).update(exp.select(rows), PolicyLossSpec(clip_low=0.2, clip_high=0.28, kl_coef=0.0),
                                          mini_batch=GLOBAL_BATCH // env.world_size, micro_batch=2, epochs=1,
                                          generator=torch.Generator().manual_seed(1))


def watched(average: PolicyAverage, counts: dict[str, int], engine) -> None:
    """The average's update and gather, counted."""
    update, gather = average.update, average.gather

    def counted_update():
        with counting(counts, "update", engine):
            update()

    def counted_gather():
        with counting(counts, "gather", engine):
            return gather()

    average.update, average.gather = counted_update, counted_gather


def save(engine, average, root: Path, step_no: int, tokenizer, env) -> Path:
    return save_checkpoint(root, step_no, {"model": engine}, tokenizer, {}, 0, env, [average.save], [average.collect])


def run(spec: str, env, model: str, out: Path) -> None:
    """The straight run and the resumed one of one engine; see the module's docstring."""
    args, _ = parse_spec(spec + "=plain")
    folder = out / args.tag
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine, exp = make_engine(args, env, model)
    average, counts = PolicyAverage(engine, BETA, tokenizer), {}
    watched(average, counts, engine)
    for k in (1, 2, 3):
        step(engine, average, exp, env)
        if k >= 2:
            save(engine, average, folder / "straight", k, tokenizer, env)
    checkpoint = folder / "straight" / "global_step_2"
    resumed, _ = make_engine(args, env, str(checkpoint / "model"))  # the batch stays the first engine's
    assert resumed.load_state(checkpoint / "model_state"), "step 2's engine state not found"
    again = PolicyAverage(resumed, BETA, tokenizer, resume=checkpoint)
    step(resumed, again, exp, env)
    save(resumed, again, folder / "resumed", 3, tokenizer, env)
    (folder / f"collectives_{env.rank}.json").write_text(json.dumps(counts))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--engines", nargs="+", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    env = init_distributed(timeout_s=float(os.environ.get("ALIGNRL_DIST_TIMEOUT", "60")))
    for spec in args.engines:
        run(spec, env, args.model, Path(args.out))
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
