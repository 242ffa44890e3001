"""LoRA adapters on every training engine: the optimizer holds the adapters alone (DDP: a copy per rank; FSDP2: their
shards; ZeRO-2/3: their partitions), and one update on two ranks gives the merged weights of the one-process
update."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alignrl.runtime.ports import free_port
from conftest import run_group, src_path

WORKER = Path(__file__).parent / "workers" / "lora_engine_worker.py"
ATOL = 1e-6  # the ranks' reduction order moves weights by ~6e-8 here; a step moves them by ~2e-2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": "60", "PYTHONPATH": src_path()}


def test_every_engine_steps_only_the_adapters_as_one_process_does(tiny_model_dir, tmp_path):
    one = subprocess.run([sys.executable, str(WORKER), "--engines", "single", "--model", str(tiny_model_dir), "--out",
                          str(tmp_path / "one")], capture_output=True, text=True, env=_env(), timeout=200)
    assert one.returncode == 0, one.stderr[-3000:]
    engines = ["ddp", "fsdp2", "deepspeed:2", "deepspeed:3"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", str(WORKER), "--engines", *engines, "--model", str(tiny_model_dir),
           "--out", str(tmp_path / "two")]
    two = run_group(cmd, 350, env=_env())
    assert two.returncode == 0, two.stderr[-3000:]
    base = load_file(tiny_model_dir / "model.safetensors")
    expected = load_file(tmp_path / "one" / "merged_single.safetensors")
    assert set(base) <= set(expected)  # the plain model's names (a tied head is also in the state dict)
    assert max(float((expected[k] - base[k]).abs().max()) for k in base) > 1e-3  # the step did something
    single = json.loads((tmp_path / "one" / "optim_single.json").read_text())
    assert single["optimizer_elements"] == single["trainable_elements"] < single["all_elements"] / 5
    for spec in engines:
        got = load_file(tmp_path / "two" / f"merged_{spec}.safetensors")
        assert got.keys() == expected.keys()
        for k in expected:
            torch.testing.assert_close(got[k], expected[k], atol=ATOL, rtol=0, msg=f"{spec}: {k}")
        counts = json.loads((tmp_path / "two" / f"optim_{spec}.json").read_text())
        trainable = counts["trainable_elements"]
        assert trainable == single["trainable_elements"]
        if spec == "ddp":  # every rank holds the whole (adapter) optimizer
            assert counts["optimizer_elements"] == 2 * trainable
        elif spec == "fsdp2":
            assert counts["optimizer_elements"] == trainable
        else:  # ZeRO's flat partitions: the adapters, padded to a multiple of the ranks
            assert trainable <= counts["optimizer_elements"] <= trainable + 64, counts
