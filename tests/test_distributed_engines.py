"""Two gloo ranks under torchrun: every training engine takes the same step as one process on the same
global batch, saves and restores its full state, and a dead rank ends the run instead of hanging."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_group, src_path
from alignrl.runtime.env import SINGLE
from alignrl.runtime.ports import free_port
from alignrl.models.logprobs import ForwardLayout
from alignrl.train.engines import OptimSpec, build_engine

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


def one_process_step(model_dir, layout: ForwardLayout):
    """The one-process reference: the same global batch, the same update."""
    single = engine_worker.EngineArgs("single")
    torch.manual_seed(0)
    engine, exp = engine_worker.make_engine(single, SINGLE, str(model_dir), layout.share_prompt)
    engine_worker.update(engine, exp, SINGLE, layout)
    before = engine_worker.make_engine(single, SINGLE, str(model_dir))[0].full_state_dict()
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


# The layouts each engine's step is checked under: plain padded micro-batches; shared prompts, whose forward
# calls the wrapped model twice before one backward (the prompt, then the responses over its keys/values), so
# every engine must still reduce its gradients exactly once; packed (padding-free) with shared prompts, one call
# of the wrapped model per micro-batch with the attention routed to the packed path on every rank. `roundtrip`:
# full weights + state saved, an engine rebuilt from them, equal weights, and the restored engine's next step
# equals the original's (checked in the worker; with `:bf16`, the fp32 master weights the state holds make it
# so). The torch engines share one launch and DeepSpeed's stages
# another: a launch's start-up costs more than its steps.
LAUNCHES = {"torch": ["ddp:0=plain,shared", "fsdp2:0=plain,shared,packed,roundtrip", "ddp:0:bf16=roundtrip",
                      "fsdp2:0:bf16=roundtrip"],
            "deepspeed": ["deepspeed:2=plain,shared", "deepspeed:3=plain,shared,packed,roundtrip",
                          "deepspeed:3:offload=plain"]}


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_steps_match_single_process_and_state_round_trips(launch, tiny_model_dir, reference, tmp_path):
    r = torchrun(["--model", str(tiny_model_dir), "--engines", *LAUNCHES[launch]], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    for spec in LAUNCHES[launch]:
        engine, layouts = engine_worker.parse_spec(spec)
        for name in layouts:
            if name == "roundtrip":
                assert (tmp_path / f"ckpt_{engine.tag}" / "model" / "config.json").is_file()
                continue
            before, expected = reference[name]
            assert_same_step(load_file(str(tmp_path / f"weights_{engine.tag}_{name}.safetensors")), before,
                             expected, f"{engine.tag} {name}")
            reductions = tmp_path / f"reductions_{engine.tag}_{name}.json"
            if engine.strategy == "ddp":  # one all-reduce per bucket a step, not one per micro-batch (2 here)
                buckets = json.loads(reductions.read_text())
                assert buckets and len(buckets) == len(set(buckets)), buckets
    if launch == "torch":  # full weights and the FQN-keyed optimizer state move from 2-rank FSDP2 to one process
        engine, _ = engine_worker.make_engine(engine_worker.EngineArgs("single"), SINGLE,
                                              str(tmp_path / "ckpt_fsdp20" / "model"))
        assert engine.load_state(tmp_path / "ckpt_fsdp20" / "model_state")
        steps = {float(s["step"]) for s in engine.optimizer.state.values()}
        assert steps == {1.0}  # the optimizer state of the one step taken under FSDP2
        assert engine.scheduler.last_epoch == 1


def test_killed_rank_ends_the_run_instead_of_hanging(tiny_model_dir, tmp_path):
    t0 = time.time()
    r = torchrun(["--kill", "ddp", "--model", str(tiny_model_dir)], tmp_path, timeout=150)
    assert r.returncode != 0
    assert time.time() - t0 < 120
    assert "SIGKILL" in r.stderr or "Signal 9" in r.stderr
    assert "rank 0: stopped by SIGTERM (another rank failed" in r.stderr  # the survivor says why it stopped
    assert not (tmp_path / "weights.safetensors").exists()


def test_a_zero_checkpoint_of_another_world_size_is_one_line(tmp_path):
    """DeepSpeed refuses ZeRO optimizer state split over another number of ranks with a bare Exception; a resume
    says it in one line. (Its message, from deepspeed/runtime/engine.py, is what the stand-in raises.)"""
    from types import SimpleNamespace

    from alignrl.train.engines.deepspeed import TAG, DeepSpeedConfigError, DeepSpeedEngine

    (tmp_path / TAG).mkdir()

    def load_checkpoint(*_, **__):
        raise Exception("The checkpoint being loaded used a DP world size of 2 but the current world size is 1. "
                        "Automatic adjustment of ZeRO's optimizer state partitioning with a new world size is not "
                        "currently supported.")

    engine = DeepSpeedEngine.__new__(DeepSpeedEngine)
    engine.module = SimpleNamespace(load_checkpoint=load_checkpoint)
    with pytest.raises(DeepSpeedConfigError, match="world size of 2 .* resume with as many processes as wrote it"):
        engine.load_state(tmp_path)


def test_host_copies_keep_a_tied_embedding_one_tensor(tiny_model, tmp_path):
    """Weights copied to the host (a GPU's, or a ZeRO-3 gather's clone) keep tied keys on one tensor, so the
    saved folder holds the tied matrix once, as the base model does (twice before: both names written)."""
    import copy

    from alignrl.train.engines.base import host_state_dict

    model = copy.deepcopy(tiny_model[0])
    tied = ("lm_head.weight", "model.embed_tokens.weight")
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    out = host_state_dict(model, model.state_dict(), clone=True)  # clone: what a copy off the device makes
    assert out[tied[0]] is out[tied[1]] and out[tied[0]].data_ptr() != model.lm_head.weight.data_ptr()
    assert all(torch.equal(out[k], v) for k, v in model.state_dict().items())
    assert len({t.data_ptr() for t in out.values()}) == len(out) - 1  # nothing else shares
    model.save_pretrained(tmp_path, state_dict=out)
    assert set(load_file(tmp_path / "model.safetensors")) == set(out) - {"lm_head.weight"}


def two_gloo_ranks(worker: str) -> None:
    """tests/workers/`worker` under torchrun on two gloo ranks; it exits non-zero when its checks fail."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": src_path()}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", str(Path(__file__).parent / "workers" / worker)]
    r = run_group(cmd, 120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]


def test_bf16_gradients_are_summed_and_averaged_over_ranks_in_fp32(tmp_path):
    """bf16 gradients that a bf16 running sum or a bf16 all-reduce would round away: the DDP engine's fp32
    master weights keep them (workers/master_reduce_worker.py checks the exact sum on both ranks)."""
    two_gloo_ranks("master_reduce_worker.py")


def test_metrics_of_two_ranks_are_the_whole_batchs():
    """A maximum over ranks is the largest, the reward spread that of the whole batch, a rate the ranks' sum: each
    was the mean of the ranks' own (workers/metrics_worker.py checks them against one process's). Episode costs
    of unequal shares gather in rank order."""
    two_gloo_ranks("metrics_worker.py")


def test_one_process_sums_micro_batch_gradients_in_fp32():
    model = torch.nn.Linear(2, 1, bias=False).to(torch.bfloat16)
    engine = build_engine("single", model, OptimSpec(lr=1e-3, grad_clip=0.0), SINGLE)
    grads = [1.0] + [2.0 ** -9] * 64  # in bf16, 1 + 2^-9 is 1: a bf16 running sum never moves
    moved = []
    for i, g in enumerate(grads):
        engine.backward((engine.module(torch.full((1, 2), g, dtype=torch.bfloat16))).sum(), i == len(grads) - 1)
        moved.append(model.weight.grad is None)
    engine.step()
    assert engine.master.params[0].grad.tolist() == [[1.125, 1.125]]  # the gradient the step took (kept after it)
    assert all(moved)  # onto the fp32 copy as each backward made it, not kept twice
    stepped = engine.master.params[0].detach().clone()
    engine.step()  # no backward since: no gradient, nothing moves
    assert torch.equal(engine.master.params[0], stepped)


def test_a_bf16_model_trains_through_fp32_master_weights():
    """At lr 1e-5 every AdamW update of a weight near 0.02 is below half of bf16's step there (6e-5): stepped
    in place, the bf16 weights never move. The engine steps an fp32 copy instead: it follows the fp32 run, and
    the model holds it rounded to bf16, moved once the updates add up; its saved state carries the fp32 copy."""
    from alignrl.train.engines import OptimSpec, build_engine

    def run(dtype, steps=20):
        torch.manual_seed(0)
        lin = torch.nn.Linear(64, 64, bias=False)
        with torch.no_grad():  # in [0.016, 0.031), one bf16 binade, and exact in bf16: both runs start equal
            lin.weight.copy_((0.016 + 0.015 * torch.rand(64, 64)).bfloat16().float())
        # entries in {-1, 0, 1}: the gradient (sums of 16 products) is exact in bf16 too, so both runs step alike
        x, target = torch.randint(-1, 2, (16, 64)).float(), torch.randint(-1, 2, (16, 64)).float()
        engine = build_engine("single", lin.to(dtype), OptimSpec(lr=1e-5, grad_clip=0.0), SINGLE)
        w0 = lin.weight.detach().clone()
        for _ in range(steps):
            engine.backward((lin(x.to(dtype)).float() * target).sum())
            engine.step()
        return engine, w0

    ref, _ = run(torch.float32)
    engine, w0 = run(torch.bfloat16)
    master = engine.master.shadow.weight
    assert master.dtype == torch.float32 and engine.model.weight.dtype == torch.bfloat16
    torch.testing.assert_close(master, ref.model.weight, atol=1e-7, rtol=0)  # 20 updates of 1e-5 each: 2e-4
    assert torch.equal(engine.model.weight, master.bfloat16())
    moved = (ref.model.weight - w0).abs() > 1.3e-4  # more than one bf16 step (1.2e-4) in the fp32 run
    assert float(moved.float().mean()) > 0.5 and bool((engine.model.weight != w0)[moved].all())
    state = engine.master.state_dict()
    fresh, _ = run(torch.bfloat16, steps=0)
    fresh.master.load_state_dict(state)
    assert torch.equal(fresh.master.shadow.weight, master) and torch.equal(fresh.model.weight, engine.model.weight)


def test_the_logged_learning_rate_is_the_one_each_step_took():
    """Warm-up shows in the logs: lr() is the rate of the latest step, not the scheduler's next one (which hid a
    2-step warm-up: 1e-3 logged from the first step on)."""
    model = torch.nn.Linear(2, 1, bias=False)
    engine = build_engine("single", model, OptimSpec(lr=1e-3, warmup_steps=2, total_steps=4), SINGLE)
    seen = []
    for _ in range(3):
        engine.backward(model(torch.ones(1, 2)).sum(), True)
        engine.step()
        seen.append(engine.lr())
    assert seen == pytest.approx([5e-4, 1e-3, 1e-3])


def test_the_ray_engines_shares_merge_into_the_whole_batchs_metrics():
    """Ray's rollout engines each make a share: the merged metrics are the whole batch's (they were the shares'
    unweighted means: a fractional response/length_max, the mean of the shares' reward spreads)."""
    from alignrl.rl.producer import merged_metrics

    a, b = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, 0.0, 1.0])
    parts = [({"reward/mean": float(a.mean()), "reward/std": float(a.std()), "response/length_max": 5.0,
               "response/length_mean": 3.0}, 6),
             ({"reward/mean": float(b.mean()), "reward/std": float(b.std()), "response/length_max": 9.0,
               "response/length_mean": 8.0}, 4)]
    whole = torch.cat([a, b])
    assert merged_metrics(parts) == pytest.approx({"reward/mean": float(whole.mean()), "reward/std": float(whole.std()),
                                                   "response/length_max": 9.0, "response/length_mean": 5.0})


def test_deepspeeds_deprecated_collective_warnings_are_quiet(monkeypatch):
    """DeepSpeed's ZeRO calls torch's all_gather_into_tensor and reduce_scatter_tensor, which warn on every call
    (4 lines in a 2-step run); other FutureWarnings still show."""
    import warnings

    from alignrl.runtime.env import quiet_deepspeed

    monkeypatch.setenv("DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", ""))  # quiet_deepspeed may set it
    monkeypatch.delenv("DS_ACCELERATOR")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_deepspeed()
        for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            warnings.warn(f"`torch.distributed.{name}` is deprecated. Use ...", FutureWarning)
        warnings.warn("`torch.distributed.something_else` is deprecated.", FutureWarning)
    assert [str(w.message) for w in seen] == ["`torch.distributed.something_else` is deprecated."]


def test_fsdp2_in_one_process_is_one_line_naming_both_fixes():
    from alignrl.errors import UserError
    from alignrl.train.engines.base import OptimSpec
    from alignrl.train.engines.fsdp2 import FSDP2Engine

    with pytest.raises(UserError, match="launch with torchrun --nproc_per_node=N") as e:
        FSDP2Engine(torch.nn.Linear(2, 2), OptimSpec(lr=1e-3), SINGLE)
    assert "\n" not in str(e.value) and "strategy=single" in str(e.value)
