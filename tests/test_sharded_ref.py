"""A reference model sharded over two gloo ranks (FSDP2, as the Ray reference group holds it under ZeRO-3 or
verl's FSDP) scores the same log-probs as a whole copy, though the ranks get shares of different sizes (their
forwards are collective), and each rank holds about half of the weights."""

import json
import os
import sys
from pathlib import Path

import pytest

from conftest import run_group, src_path
from alignrl.dist.launch import free_port

WORKER = Path(__file__).parent / "workers" / "sharded_ref_worker.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_a_sharded_reference_scores_what_a_whole_copy_does(tiny_model_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": "60", "PYTHONPATH": src_path()}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", str(WORKER), "--model", str(tiny_model_dir), "--out", str(tmp_path / "r")]
    done = run_group(cmd, 180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"r.{r}.json").read_text()) for r in (0, 1)]
    # the same weights in the same order of operations: equal up to the packed/shared layouts' own rounding
    assert all(r["worst"] <= 1e-6 for r in ranks), ranks
    total = ranks[0]["total"]
    assert sum(r["held"] for r in ranks) == total, ranks  # every weight on exactly one rank
    assert all(r["held"] < 0.6 * total for r in ranks), ranks
