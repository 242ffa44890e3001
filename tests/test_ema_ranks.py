"""The policy's moving average (actor.ema_beta) on two gloo ranks: each rank averages its own FSDP2 shards or ZeRO-3
partitions with no communication at each step, the checkpoint's ema/ (gathered on rank 0 only then) is the
one-process run's, and a resume carries each rank's part on to the same next average."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_group
from safetensors.torch import load_file

from alignrl.runtime.env import SINGLE
from alignrl.runtime.ports import free_port

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import ema_worker  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "ema_worker.py"
# two ranks sum gradients in another order than one process (~1e-7 a step, test_distributed_engines.ATOL)
ATOL = 1e-6
SHARDED = {"fsdp2:0": "fsdp20", "deepspeed:3": "deepspeed3"}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def average(root: Path, run: str, step: int) -> dict[str, torch.Tensor]:
    return load_file(root / run / f"global_step_{step}" / "ema" / "model.safetensors")


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory) -> Path:
    """The same three steps, checkpoints and resume on the single engine."""
    out = tmp_path_factory.mktemp("ema_single")
    ema_worker.run("single:0", SINGLE, str(tiny_model_dir), out)
    return out / "single0"


def test_sharded_averages_are_the_one_process_average_and_resume(tiny_model_dir, one_process, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": "60"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", str(WORKER), "--model", str(tiny_model_dir), "--out", str(tmp_path),
           "--engines", *SHARDED]
    r = run_group(cmd, 200, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    base = load_file(tiny_model_dir / "model.safetensors")
    for tag in SHARDED.values():
        for step in (2, 3):
            want = average(one_process, "straight", step)
            got = average(tmp_path / tag, "straight", step)
            assert got.keys() == want.keys() == base.keys()  # the tied embedding written once, as the model has it
            # the average moved well past the tolerance, so agreement is not vacuous
            assert max(float((want[k] - base[k].float()).abs().max()) for k in base) > 1e-4
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=0, atol=ATOL, msg=lambda m, k=k: f"{tag} {k}: {m}")
        straight, resumed = average(tmp_path / tag, "straight", 3), average(tmp_path / tag, "resumed", 3)
        for k in straight:  # a resume carries the average on bit for bit
            assert torch.equal(resumed[k], straight[k]), (tag, k, float((resumed[k] - straight[k]).abs().max()))
        for rank in (0, 1):
            counts = json.loads((tmp_path / tag / f"collectives_{rank}.json").read_text())
            assert counts["update"] == 0, (tag, rank, counts)  # the step's update stays on the rank
            assert counts["gather"] > 0, (tag, rank, counts)  # the count does see a collective: the save's gather
