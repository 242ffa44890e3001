"""Online DPO (algorithm.adv_estimator=online_dpo) on two gloo ranks under torchrun: each rank trains its share of the
prompt pairs, and the weights after two RL steps are one process's on the whole batch, so the pairs stay whole and
the loss's mean over the pairs (the answers it counts summed over every rank) is the global batch's."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_group
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from alignrl.runtime.env import SINGLE
from alignrl.runtime.ports import free_port

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import online_dpo_worker  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "online_dpo_worker.py"
# the ranks sum gradients in another order than one process (~1e-7 after an AdamW step, tests/test_distributed_
# engines.py); 1e-6 leaves room for that and nothing else
ATOL = 1e-6
STRATEGIES = ["ddp", "fsdp2"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_two_ranks_train_the_weights_of_one_process(tiny_model_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": "60"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", str(WORKER), "--model", str(tiny_model_dir), "--strategies", *STRATEGIES,
           "--out", str(tmp_path)]
    r = run_group(cmd, 180, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    expected, metrics = online_dpo_worker.train_steps(SINGLE, str(tiny_model_dir), "single")
    before = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).state_dict()
    moved = max(float((expected[k] - before[k]).abs().max()) for k in expected)
    assert moved > 1e-3  # the steps did something, so agreement is not vacuous
    assert metrics[0]["dpo/loss"] > 0 and metrics[1]["dpo/loss"] > 0
    for strategy in STRATEGIES:
        got = load_file(str(tmp_path / f"weights_{strategy}.safetensors"))
        assert set(got) == set(expected)
        for k in expected:
            torch.testing.assert_close(got[k], expected[k], atol=ATOL, rtol=0, msg=f"{strategy}: {k}")
        # each rank holds as many pairs, so the mean of the ranks' losses is the batch's
        logged = json.loads((tmp_path / f"metrics_{strategy}.json").read_text())
        for step, (two, one) in enumerate(zip(logged, metrics), start=1):
            assert two["dpo/loss"] == pytest.approx(one["dpo/loss"], abs=1e-6), (strategy, step)
