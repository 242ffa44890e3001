"""Vision-language models sharded over two gloo ranks. A reference (FSDP2, as the Ray reference group holds it under
ZeRO-3) scores image prompts as a whole copy does, though one rank has fewer micro-batches, and also when one rank's
prompts are text-only (its forwards run the sharded image encoder on a blank patch). A vision critic on DDP, FSDP2 and
DeepSpeed ZeRO-3 ranks, one with images and one without, takes the update one process takes on the whole batch."""

import json
import os
import sys
from pathlib import Path

import pytest

import torch
from safetensors.torch import load_file

from conftest import run_group, src_path
from alignrl.runtime.ports import free_port

WORKERS = Path(__file__).parent / "workers"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def run_ranks(model_dir, out, *extra, worker: str = "vision_sharded_ref_worker.py"):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": "60", "PYTHONPATH": src_path()}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", str(WORKERS / worker), "--model", str(model_dir), "--out", str(out), *extra]
    return run_group(cmd, 240, env=env)


@pytest.mark.parametrize("mixed", [False, True], ids=["images", "images-and-text"])
def test_a_sharded_vision_reference_scores_what_a_whole_copy_does(vl_dir, tmp_path, mixed):
    done = run_ranks(vl_dir, tmp_path / "r", *(["--mixed"] if mixed else []))
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"r.{r}.json").read_text()) for r in (0, 1)]
    assert all(r["worst"] <= 1e-5 for r in ranks), ranks


def test_vision_critics_on_ranks_with_and_without_images_take_the_step_one_process_takes(vl_dir, tmp_path):
    """One critic update of four prompts (ragged responses, two per rank, a micro-batch each), rank 0's with
    images and rank 1's text-only: the full weights after it on two DDP, two FSDP2 and two ZeRO-3 ranks equal those
    of one process taking the whole batch. Rank 1's forwards run the image encoder on a blank patch; without it the
    ranks' collectives paired wrongly (gloo's "collective mismatch" under DDP). The optimizer's first step is close
    to the gradient itself (the worker's Adam eps 1, no clipping), so a gradient the ranks scaled or summed wrongly
    fails it. Measured: the step moved every tensor (the image encoder's included) by at least 7e-5, the ranks'
    summation order by at most 1.2e-7."""
    engines = ("ddp", "fsdp2", "deepspeed")
    done = run_ranks(vl_dir, tmp_path, "--engines", *engines, "--mixed", worker="vision_critic_worker.py")
    assert done.returncode == 0, done.stderr[-3000:]
    before, single = (load_file(tmp_path / f"{name}.safetensors") for name in ("before", "single"))
    visual = [k for k in single if ".visual." in k]
    assert visual and "score.weight" in single
    assert min(float((single[k] - before[k]).abs().max()) for k in single) > 3e-5  # every tensor moved
    for engine in engines:
        got = load_file(tmp_path / f"{engine}.safetensors")
        assert got.keys() == single.keys(), engine
        for k in single:
            torch.testing.assert_close(got[k], single[k], atol=1e-6, rtol=0, msg=f"{engine}: {k}")
