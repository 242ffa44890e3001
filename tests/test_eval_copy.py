"""A sharded policy (FSDP2 over two gloo ranks) beside producers in other processes: the held-out evaluation runs on
the producers' engines when they have one (the Ray placement's rollout engines), and otherwise on one full copy on
rank 0 that follows every publish (the ZeroMQ placement). No other rank holds a copy: on a big model a whole copy
beside each rank's shard does not fit the GPU. Beside the producers' engines the policy is even built in its shards
(FSDP2: on the meta device, each rank reading its rows; ZeRO-3: deepspeed.zero.Init), with the base weights exact."""

import json
import os
import sys
from pathlib import Path

import pytest

from alignrl.runtime.ports import free_port
from conftest import run_group, src_path

WORKER = Path(__file__).parent / "workers" / "eval_copy_worker.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_only_rank_0_holds_an_evaluation_copy_and_none_beside_producer_engines(tiny_model_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": "60", "PYTHONPATH": src_path(),
           "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", str(WORKER), "--model", str(tiny_model_dir), "--out", str(tmp_path / "r")]
    done = run_group(cmd, 180, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"r.{r}.json").read_text()) for r in (0, 1))
    for name in ("own", "zero3 own"):
        assert rank0[name] == {"copy": True, "copy_follows": True, "evaluator": False, "fanout": True,
                               "loaded_right": True, "partitioned": False}, rank0
        assert rank1[name] == {"copy": False, "copy_follows": False, "evaluator": False, "fanout": True,
                               "loaded_right": True, "partitioned": False}, rank1
    for r in (rank0, rank1):
        # beside the producers' engines nothing needs the whole model: the policy is built in its shards
        for name in ("producers", "bf16 producers", "zero3 producers"):
            assert r[name] == {"copy": False, "copy_follows": False, "evaluator": True, "fanout": False,
                               "loaded_right": True, "partitioned": True}, r
