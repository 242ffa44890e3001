"""One rank of the sharded vision critic test (torchrun, two gloo ranks): a value model made from the tiny Qwen2-VL
folder (its image encoder included) takes one PPO critic update on a fixed batch of image prompts, the rows split
over the ranks, on each engine of `--engines`; rank 0 saves each engine's full weights, and also the weights of the
same update of the whole batch in one process (`single`) and the weights before it (`before`)."""

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from alignrl.data.images import ImageRows
from alignrl.data.records import Experience
from alignrl.models.loader import load_tokenizer
from alignrl.models.value import load_value_model
from alignrl.runtime.env import SINGLE, barrier, init_distributed, shard, shutdown
from alignrl.train.critic import Critic
from alignrl.train.engines import OptimSpec, build_engine

sys.path.insert(0, str(Path(__file__).parent))
from vision_sharded_ref_worker import image_rows  # noqa: E402

ROWS = 4
# Adam's first step is lr·g/(|g|+eps): with eps 1 and no clipping it is close to g itself, so a gradient the ranks
# scaled or summed wrongly moves the weights otherwise (with a small eps the step would be lr·sign(g), blind to scale)
SPEC = OptimSpec(lr=1.0, total_steps=10, grad_clip=0.0, eps=1.0)


def fixed_batch(model_dir: str, folder: Path, mixed: bool = False) -> tuple[Experience, torch.Tensor, torch.Tensor]:
    """Four image prompts with ragged responses, and deterministic old values and returns (B, R). `mixed`: the
    second half of the rows (rank 1's share) are text-only, their image tokens replaced by a plain one."""
    tokenizer = load_tokenizer(Path(model_dir))
    (pids, pmask, rids, rmask), images = image_rows(tokenizer, folder, ROWS)
    if mixed:
        text = torch.arange(ROWS)[:, None] >= ROWS // 2
        image_token = json.loads((Path(model_dir) / "config.json").read_text())["image_token_id"]
        pids = pids.masked_fill(text & (pids == image_token), 11)
        images = ImageRows(images.rows[:ROWS // 2] + [None] * (ROWS - ROWS // 2))
    g = torch.Generator().manual_seed(0)
    old_values = torch.randn(rids.shape, generator=g) * rmask
    returns = (old_values + torch.randn(rids.shape, generator=g)) * rmask
    zeros = torch.zeros(rids.shape)
    return Experience(pids, pmask, rids, rmask, zeros, None, zeros, images=images), old_values, returns


def step(strategy: str, model_dir: str, batch, env) -> dict[str, torch.Tensor]:
    """This rank's share of the batch through one critic update on a fresh engine -> the full weights after it."""
    exp, old_values, returns = batch
    engine = build_engine(strategy, load_value_model(model_dir, seed=0, log=lambda *_: None), SPEC, env,
                          zero_stage=3)
    rows = torch.tensor(shard(list(range(ROWS)), env))
    Critic(engine, cliprange_value=0.2).update(exp.select(rows), old_values[rows], returns[rows],
                                               mini_batch=ROWS // env.world_size, micro_batch=1, epochs=1,
                                               generator=torch.Generator().manual_seed(1))
    return engine.full_state_dict()


def save(weights: dict[str, torch.Tensor], out: Path, name: str) -> None:
    save_file({k: v.detach().clone().contiguous() for k, v in weights.items()}, str(out / f"{name}.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--engines", nargs="+", required=True)
    ap.add_argument("--mixed", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    env = init_distributed("cpu")
    out = Path(a.out)
    batch = fixed_batch(a.model, out, a.mixed)
    for strategy in a.engines:
        full = step(strategy, a.model, batch, env)
        if env.is_main:
            save(full, out, strategy)
        barrier(env)
    if env.is_main:  # the one-process reference, while the other rank waits at the barrier
        save(step("single", a.model, batch, SINGLE), out, "single")
        save(load_value_model(a.model, seed=0, log=lambda *_: None).state_dict(), out, "before")
    barrier(env)
    shutdown()


if __name__ == "__main__":
    main()
