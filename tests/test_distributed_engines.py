"""Two gloo ranks under torchrun: every training engine takes the same step as one process on the same
global batch, saves and restores its full state, and a dead rank ends the run instead of hanging."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_group
from alignrl.dist.env import SINGLE
from alignrl.dist.launch import free_port
from alignrl.models.logprobs import Layout

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import engine_worker  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "engine_worker.py"
# Two ranks sum their gradients in a different order than one process: observed differences are
# ~1e-7 after one AdamW step of lr 1e-2; 1e-6 leaves room for that and nothing else.
ATOL = 1e-6

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def torchrun(args: list[str], out: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": "60"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", str(WORKER), *args, "--out", str(out)]
    return run_group(cmd, timeout, env=env)


def one_process_step(model_dir, layout: Layout):
    """The one-process reference: the same global batch, the same update."""
    class Args:
        strategy, zero_stage = "single", 2

    torch.manual_seed(0)
    engine, exp = engine_worker.make_engine(Args, SINGLE, str(model_dir), layout.share_prompt)
    engine_worker.update(engine, exp, SINGLE, layout)
    before = engine_worker.make_engine(Args, SINGLE, str(model_dir))[0].full_state_dict()
    return before, engine.full_state_dict()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The one-process step of each layout: (weights before, weights after)."""
    return {name: one_process_step(tiny_model_dir, layout) for name, layout in engine_worker.LAYOUTS.items()}


def assert_same_step(got, before, expected, what):
    assert set(got) == set(expected)
    moved = max(float((expected[k] - before[k]).abs().max()) for k in expected)
    assert moved > 1e-3  # the step did something, so agreement is not vacuous
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], atol=ATOL, rtol=0, msg=f"{what}: {k}")


# The layouts each engine's step is checked under, all in one launch per engine (a launch's start-up costs
# more than its steps): plain padded micro-batches; shared prompts, whose forward calls the wrapped model
# twice before one backward (the prompt, then the responses over its keys/values), so every engine must
# still reduce its gradients exactly once; packed (padding-free) with shared prompts, one call of the
# wrapped model per micro-batch with the attention routed to the packed path on every rank.
STEPS = {("ddp", 0, False): "plain,shared", ("fsdp2", 0, False): "plain,shared,packed",
         ("deepspeed", 2, False): "plain,shared", ("deepspeed", 3, False): "plain,shared,packed",
         ("deepspeed", 3, True): "plain"}


@pytest.mark.parametrize("strategy,stage,offload", list(STEPS))
def test_steps_match_single_process(strategy, stage, offload, tiny_model_dir, reference, tmp_path):
    layouts = STEPS[(strategy, stage, offload)]
    r = torchrun(["--strategy", strategy, "--zero-stage", str(stage), "--model", str(tiny_model_dir),
                  "--layouts", layouts, *(["--offload"] if offload else [])], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    for name in layouts.split(","):
        before, expected = reference[name]
        assert_same_step(load_file(str(tmp_path / f"weights_{name}.safetensors")), before, expected,
                         f"{strategy} {name}")


@pytest.mark.parametrize("strategy,stage", [("fsdp2", 0), ("deepspeed", 3)])
def test_save_load_round_trip_and_resume_continues_identically(strategy, stage, tiny_model_dir, tmp_path):
    """In the worker: full weights + state saved, rebuilt from them, equal weights, and the next step of
    the restored engine equals the next step of the original one."""
    r = torchrun(["--strategy", strategy, "--zero-stage", str(stage), "--model", str(tiny_model_dir),
                  "--mode", "roundtrip"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "ckpt" / "model" / "config.json").is_file()
    if strategy != "fsdp2":
        return

    # Full weights and the FQN-keyed optimizer state move from 2-rank FSDP2 to a single process.
    class Args:
        strategy, zero_stage = "single", 2

    engine, _ = engine_worker.make_engine(Args, SINGLE, str(tmp_path / "ckpt" / "model"))
    assert engine.load_state(tmp_path / "ckpt")
    steps = {float(s["step"]) for s in engine.optimizer.state.values()}
    assert steps == {1.0}  # the optimizer state of the one step taken under FSDP2
    assert engine.scheduler.last_epoch == 1


def test_killed_rank_ends_the_run_instead_of_hanging(tiny_model_dir, tmp_path):
    t0 = time.time()
    r = torchrun(["--strategy", "ddp", "--model", str(tiny_model_dir), "--mode", "kill"], tmp_path, timeout=150)
    assert r.returncode != 0
    assert time.time() - t0 < 120
    assert "SIGKILL" in r.stderr or "Signal 9" in r.stderr
    assert "rank 0: stopped because another rank failed" in r.stderr  # the survivor says why it stopped
    assert not (tmp_path / "weights.safetensors").exists()
