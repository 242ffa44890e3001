"""What the ZeroMQ pipeline tests share: a small run's overrides, trainer and sampler processes started in sessions
of their own (and stopped by their PIDs), the checkpoints' weights, and the prompt accounting of a run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from conftest import src_path

SMALL = ["data.train_size=64", "data.val_size=8", "data.val_size_during_training=4", "data.train_batch_size=4",
         "rollout.n=4", "rollout.max_new_tokens=8", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=4",
         "actor.lr=1e-3", "actor.kl_loss_coef=0.01", "trainer.test_freq=0", "trainer.progress_bar=false",
         "trainer.logger=[jsonl]", "trainer.threads=1"]


def overrides(model_dir, out, name, steps, ports, *extra):
    return SMALL + [f"model.path={model_dir}", f"trainer.output_dir={out}", f"trainer.experiment_name={name}",
                    f"trainer.total_training_steps={steps}", "trainer.save_freq=2",
                    f"pipeline.data_port={ports[0]}", f"pipeline.sync_port={ports[1]}", *extra]


def spawn(*args, env: dict | None = None, **kw):
    env = {**os.environ, "PYTHONPATH": src_path(), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "alignrl", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True, **kw)


def sampler(model_dir, ports, *extra, env: dict | None = None):
    return spawn("sample", "--model-path", str(model_dir), "--data-port", str(ports[0]), "--sync-port",
                 str(ports[1]), "--threads", "1", "--peer-timeout", "60", *extra, env=env)


def stop(*procs):
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)


def finish(trainer, *workers, timeout: float = 300) -> tuple[str, str]:
    """The trainer's stdout and stderr once it has finished; it and then every sampler must exit 0."""
    try:
        out, err = trainer.communicate(timeout=timeout)
        assert trainer.returncode == 0, err[-3000:]
        for w in workers:
            assert w.wait(timeout=60) == 0, w.stderr.read()[-2000:]
    finally:
        stop(trainer, *workers)
    return out, err


def weights(run: Path, step: int) -> dict:
    return load_file(run / "checkpoints" / f"global_step_{step}" / "model" / "model.safetensors")


def trained_rows(run: Path) -> list[list[int]]:
    return [json.loads(x)["rows"] for x in (run / "logs" / "prompts.jsonl").read_text().splitlines()]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def steps_logged(run: Path) -> int:
    path = run / "logs" / "metrics.jsonl"
    return len(path.read_text().splitlines()) - 1 if path.is_file() else 0


def samplers_logged(run: Path) -> set[str]:
    """The samplers named in the trainer's prompt log so far (read while it appends: a torn last line is skipped)."""
    from alignrl.utils.tracking import json_rows

    path = run / "logs" / "prompts.jsonl"
    return {row["sampler"] for row in json_rows(path.read_text())} if path.is_file() else set()


def assert_each_row_once(run: Path, steps: int, batch: int = 4):
    """Exact accounting: the rows the trainer's data order drew (epoch after epoch) are the rows it trained
    plus the rows its final checkpoint still owes (leases outstanding at the end), each exactly once."""
    from collections import Counter

    from alignrl.data.sampler import BatchSampler

    trained = [r for step in trained_rows(run) for r in step]
    # no uniqueness check on `trained` alone: leases that expire under load leave their rows owed, so the
    # data order may reach into the next epoch, whose rows repeat the first's; the multiset check is exact
    assert len(trained_rows(run)) == steps and len(trained) == steps * batch
    state = torch.load(run / "checkpoints" / f"global_step_{steps}" / "trainer_state.pt", weights_only=False)
    dispatch = state["source"]["dispatch"]
    order = BatchSampler(64, batch, seed=0)
    pos = dispatch["sampler"]
    drawn = [r for _ in range(pos["epoch"] * (64 // batch) + pos["offset"] // batch) for r in order.next()]
    owed = [r for queued in dispatch["requeue"] for r in queued["rows"]]
    assert Counter(trained) + Counter(owed) == Counter(drawn), "a prompt was trained twice or lost"


def assert_zmq_trains_as_in_process(model_dir: Path, out: Path, recipe: list[str], steps: int = 2) -> None:
    """The same run in-process and as a trainer with one on-policy sampler (k = 0) ends with the same weights, bit
    for bit, and they moved from the base: the sampler made exactly the in-process loop's batches."""
    from safetensors.torch import load_file

    from alignrl.config import load_config
    from alignrl.runner import train_grpo
    from alignrl.runtime.ports import free_ports

    ports = free_ports(2)
    train_grpo(load_config(None, overrides(model_dir, out, "inline", steps, ports, *recipe)))
    trainer = spawn("train", "grpo", *overrides(model_dir, out, "zmq", steps, ports, *recipe,
                                                 "pipeline.placement=zmq", "pipeline.peer_timeout_s=120"))
    finish(trainer, sampler(model_dir, ports))
    a, b = weights(out / "inline", steps), weights(out / "zmq", steps)
    base = load_file(str(model_dir / "model.safetensors"))
    assert any(not torch.equal(a[k], base[k]) for k in a if k in base)  # the run trained
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
