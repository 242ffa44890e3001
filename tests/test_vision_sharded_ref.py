"""Vision-language models sharded over two gloo ranks. A reference (FSDP2, as the Ray reference group holds it under
ZeRO-3) scores image prompts as a whole copy does, though one rank has fewer micro-batches (its padding forwards run
the sharded image encoder too); ranks scoring image and text-only prompts in one call are refused with one line. A
vision critic on FSDP2 and on DeepSpeed ZeRO-3 takes the update one process takes on the whole batch."""

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


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    from alignrl.models.tiny_vl import build_tiny_vl

    return build_tiny_vl(tmp_path_factory.mktemp("vl") / "tiny-vl", seed=0)


def run_ranks(model_dir, out, *extra, worker: str = "vision_sharded_ref_worker.py"):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": "60", "PYTHONPATH": src_path()}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", str(WORKERS / worker), "--model", str(model_dir), "--out", str(out), *extra]
    return run_group(cmd, 240, env=env)


def test_a_sharded_vision_reference_scores_what_a_whole_copy_does(vl_dir, tmp_path):
    done = run_ranks(vl_dir, tmp_path / "r")
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"r.{r}.json").read_text()) for r in (0, 1)]
    assert all(r["worst"] <= 1e-5 for r in ranks), ranks


def test_image_and_text_prompts_across_ranks_are_one_line(vl_dir, tmp_path):
    done = run_ranks(vl_dir, tmp_path / "m", "--mixed")
    assert done.returncode != 0
    said = [x for x in done.stderr.splitlines() if "all have images or none do" in x]
    assert said and all(x.startswith("reference rank ") for x in said), done.stderr[-2000:]


def test_a_sharded_vision_critic_takes_the_step_one_process_takes(vl_dir, tmp_path):
    """One critic update of four image prompts (ragged responses, two per rank, a micro-batch each): the full
    weights after it on two FSDP2 ranks and on two ZeRO-3 ranks equal those of one process taking the whole batch.
    The optimizer's first step is close to the gradient itself (the worker's Adam eps 1, no clipping), so a gradient
    the ranks scaled or summed wrongly fails it. Measured: the step moved every tensor (the image encoder's
    included) by at least 1.5e-4, the ranks' summation order by at most 6e-8 (FSDP2) and 1.2e-7 (ZeRO-3)."""
    done = run_ranks(vl_dir, tmp_path, "--engines", "fsdp2", "deepspeed", worker="vision_critic_worker.py")
    assert done.returncode == 0, done.stderr[-3000:]
    before, single = (load_file(tmp_path / f"{name}.safetensors") for name in ("before", "single"))
    visual = [k for k in single if ".visual." in k]
    assert visual and "score.weight" in single
    assert min(float((single[k] - before[k]).abs().max()) for k in single) > 5e-5  # every tensor moved
    for engine in ("fsdp2", "deepspeed"):
        got = load_file(tmp_path / f"{engine}.safetensors")
        assert got.keys() == single.keys(), engine
        for k in single:
            torch.testing.assert_close(got[k], single[k], atol=1e-6, rtol=0, msg=f"{engine}: {k}")
