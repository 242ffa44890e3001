"""Run under torchrun with 2 ranks: a bf16 model's gradients summed over micro-batches and averaged over the
ranks by the DDP engine's fp32 master weights. Each rank's micro-batch gradients are exact in bf16, but their sums
are not: rank 0 adds 32 gradients of 2^-9 to one of 1 (a bf16 running sum stays at 1), rank 1 adds 33 of 2^-9.
Exits non-zero unless the master gradient is the exact fp32 sum over micro-batches and ranks."""

import sys

import torch

from alignrl.runtime.env import init_distributed, shutdown
from alignrl.train.engines import OptimSpec, build_engine

SMALL = 2.0 ** -9


def main() -> int:
    torch.set_num_threads(1)
    env = init_distributed(timeout_s=60)
    model = torch.nn.Linear(4, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0 + env.rank)  # rank 1's weights differ: the engine starts both from rank 0's
    engine = build_engine("ddp", model, OptimSpec(lr=1e-3, grad_clip=0.0), env)
    assert torch.equal(model.weight, torch.ones_like(model.weight)), "ranks did not start from rank 0's weights"
    grads = [1.0] + [SMALL] * 32 if env.rank == 0 else [SMALL] * 33
    for i, g in enumerate(grads):
        with engine.micro_batch(i == len(grads) - 1):
            loss = (engine.module(torch.full((1, 4), g, dtype=torch.bfloat16)) / env.world_size).sum()
            engine.backward(loss, last_micro=i == len(grads) - 1)
    engine.step()
    got = engine.master.params[0].grad  # the gradient the step took (kept until the next backward)
    # each rank's loss is its share of the global one (here half its own sum): the gradient is the ranks' mean,
    # exact in fp32 (rank 0's bf16 running sum would have stayed at 1: 0.532)
    want = (1.0 + 65 * SMALL) / env.world_size
    assert got.dtype == torch.float32 and torch.equal(got, torch.full_like(got, want)), (got, want)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
