"""A vision-language reference sharded over two gloo ranks (FSDP2, as the Ray reference group holds it under ZeRO-3)
scores image prompts as a whole copy does, though one rank has fewer micro-batches (its padding forwards run the
sharded image encoder too); ranks scoring image and text-only prompts in one call are refused with one line."""

import json
import os
import sys
from pathlib import Path

import pytest

from conftest import run_group, src_path
from alignrl.runtime.ports import free_port

WORKER = Path(__file__).parent / "workers" / "vision_sharded_ref_worker.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    from alignrl.models.tiny_vl import build_tiny_vl

    return build_tiny_vl(tmp_path_factory.mktemp("vl") / "tiny-vl", seed=0)


def run_ranks(model_dir, out, *extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": "60", "PYTHONPATH": src_path()}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", str(WORKER), "--model", str(model_dir), "--out", str(out), *extra]
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
