"""Checkpoints that are complete or ignored: a manifest written last decides; resume takes the newest complete
checkpoint and says why newer ones were skipped; nothing that existed is deleted; non-finite weights are
never written. The end-to-end cases run `python -m alignrl train grpo` as a subprocess."""

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alignrl.runner import train_grpo
from alignrl.config import load_config
from alignrl.data.loaders import DataError
from alignrl.runtime.env import SINGLE
from alignrl.train.checkpoint import (MANIFEST, TRACKER, CheckpointError, load_trainer_state, manifest_problem,
                                      resume_point, save_checkpoint, write_manifest)
from conftest import src_path

REPO = Path(__file__).resolve().parents[1]
SMALL = ["data.train_size=64", "data.val_size=8", "data.val_size_during_training=4", "data.train_batch_size=4",
         "rollout.n=4", "rollout.max_new_tokens=8", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=4",
         "actor.lr=1e-3", "trainer.test_freq=0", "trainer.progress_bar=false", "trainer.logger=[jsonl]"]


def _overrides(model_dir, out, name, steps, save_freq=2):
    return SMALL + [f"model.path={model_dir}", f"trainer.output_dir={out}", f"trainer.experiment_name={name}",
                    f"trainer.total_training_steps={steps}", f"trainer.save_freq={save_freq}"]


def _snapshot(root: Path) -> set[tuple[str, str]]:
    """(global_step_N/file, content hash) of every checkpoint file under `root`, wherever its folder now
    lives: a folder moved aside keeps its entries, so 'nothing deleted' is a subset check on these."""
    out = set()
    for p in root.rglob("*"):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and "global_step_" in rel:
            out.add((rel[rel.index("global_step_"):], hashlib.sha256(p.read_bytes()).hexdigest()))
    return out


def _fake(root: Path, step: int) -> Path:
    """A complete checkpoint as save_checkpoint leaves it, with small stand-in files."""
    folder = root / f"global_step_{step}"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "model.safetensors").write_bytes(os.urandom(256))
    torch.save({"step": step}, folder / "trainer_state.pt")
    write_manifest(folder)
    return folder


# ---------------------------------------------------------------- the manifest and resume decisions


def _corrupt(folder: Path, how: str) -> str:
    """Damages `folder` as `how` says; returns the words the skip message must contain."""
    state = folder / "trainer_state.pt"
    if how == "truncated":
        state.write_bytes(state.read_bytes()[:20])
        return "trainer_state.pt has 20 bytes"
    if how == "no_manifest":
        (folder / MANIFEST).unlink()
        return "no manifest.json"
    if how == "missing_file":
        (folder / "model" / "model.safetensors").unlink()
        return "model/model.safetensors is missing"
    if how == "garbage_manifest":
        (folder / MANIFEST).write_text("{not json")
        return "unreadable manifest.json"
    state.write_bytes(b"not a torch file")  # the manifest is rewritten to match: only loading tells
    write_manifest(folder)
    return "unreadable trainer_state.pt"


@pytest.mark.parametrize("how", ["truncated", "no_manifest", "missing_file", "garbage_manifest", "unpicklable"])
def test_damaged_newest_checkpoint_is_skipped_named_and_kept(how, tmp_path):
    root = tmp_path / "checkpoints"
    _fake(root, 2)
    words = _corrupt(_fake(root, 4), how)
    (root / TRACKER).write_text("4")
    before = _snapshot(root)
    lines = []
    assert resume_point(root, "auto", log=lines.append) == root / "global_step_2"
    assert len(lines) == 1 and "global_step_4" in lines[0] and words in lines[0], lines
    assert "resuming from global_step_2" in lines[0] and f"{TRACKER} says '4', ignored" in lines[0]
    assert before <= _snapshot(root)  # moved aside, byte for byte, not deleted
    assert not (root / "global_step_4").exists()  # the run will write step 4 again: it must not find it there
    assert [p.name for p in root.glob("incomplete-*/global_step_4")] == ["global_step_4"]


def test_garbage_tracker_is_ignored(tmp_path):
    root = tmp_path / "checkpoints"
    _fake(root, 2)
    _fake(root, 4)
    lines = []
    for garbage, shown in ((b"banana", "'banana'"), (b"\xff\xfe2", "'\ufffd\ufffd2'"), (b"2", "'2'")):
        (root / TRACKER).write_bytes(garbage)
        assert resume_point(root, "auto", log=lines.append) == root / "global_step_4"
        assert lines[-1] == ("resuming from global_step_4, the newest complete checkpoint; "
                             f"{TRACKER} says {shown}, ignored")
    (root / TRACKER).write_text("4\n")
    assert resume_point(root, "auto", log=lines.append) == root / "global_step_4" and len(lines) == 3
    assert sorted(p.name for p in root.iterdir()) == ["global_step_2", "global_step_4", TRACKER]


def test_no_complete_checkpoint_starts_fresh_and_keeps_the_folders(tmp_path):
    root = tmp_path / "checkpoints"
    _corrupt(_fake(root, 2), "no_manifest")
    _corrupt(_fake(root, 4), "truncated")
    before = _snapshot(root)
    lines = []
    assert resume_point(root, "auto", log=lines.append) is None
    assert len(lines) == 1 and lines[0].startswith(f"no complete checkpoint in {root}: global_step_4 (")
    assert "global_step_2 (no manifest.json" in lines[0] and "starting fresh" in lines[0], lines
    assert before <= _snapshot(root) and not list(root.glob("global_step_*"))


def test_disable_starts_fresh_and_keeps_the_checkpoints(tmp_path):
    root = tmp_path / "checkpoints"
    _fake(root, 2)
    _fake(root, 4)
    before = _snapshot(root)
    lines = []
    assert resume_point(root, "disable", log=lines.append) is None
    assert len(lines) == 1 and "trainer.resume_mode=disable: starting fresh" in lines[0]
    assert "global_step_4, global_step_2" in lines[0] and "not deleted" in lines[0]
    assert before <= _snapshot(root)
    assert sorted(p.name for p in root.glob("previous_run-*/global_step_*")) == ["global_step_2", "global_step_4"]
    assert resume_point(root, "disable", log=lines.append) is None and len(lines) == 1  # nothing left to move


def test_corrupt_trainer_state_is_a_one_line_error(tmp_path):
    folder = _fake(tmp_path, 3)
    (folder / "trainer_state.pt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(CheckpointError) as e:
        load_trainer_state(folder)
    assert isinstance(e.value, DataError)  # the CLIs print DataErrors as one line
    msg = str(e.value)
    assert "\n" not in msg and str(folder / "trainer_state.pt") in msg and "trainer.resume_mode=disable" in msg


# ---------------------------------------------------------------- save: manifest, rotation, non-finite weights


@pytest.fixture
def engine(tiny_model_dir):
    from alignrl.models.loader import load_model
    from alignrl.train.engines import OptimSpec, build_engine

    model, tokenizer = load_model(str(tiny_model_dir))  # its own copy: one test poisons it
    return build_engine("single", model, OptimSpec(lr=1e-3), SINGLE), tokenizer


def test_save_writes_a_manifest_and_rotates_only_complete_checkpoints(engine, tmp_path):
    eng, tok = engine
    root = tmp_path / "checkpoints"
    stray = root / "global_step_0"  # not complete, so not ours to judge: rotation leaves it alone
    stray.mkdir(parents=True)
    (stray / "notes.txt").write_text("keep me")
    for step in (1, 2, 3):
        save_checkpoint(root, step, {"model": eng}, tok, {"x": step}, keep=2)
    assert sorted(p.name for p in root.glob("global_step_*")) == ["global_step_0", "global_step_2", "global_step_3"]
    assert manifest_problem(root / "global_step_3") is None and (root / TRACKER).read_text() == "3"
    files = json.loads((root / "global_step_3" / MANIFEST).read_text())["files"]
    assert {"model/model.safetensors", "model_state/optim.pt", "trainer_state.pt"} <= set(files)
    assert (stray / "notes.txt").read_text() == "keep me" and not list(root.glob(".global_step_*"))
    save_checkpoint(root, 4, {"model": eng}, tok, {"x": 4}, keep=0)  # 0 keeps every one (verl's default)
    assert sorted(p.name for p in root.glob("global_step_*"))[1:] == ["global_step_2", "global_step_3", "global_step_4"]


def test_a_rank_that_does_not_see_rank_0s_folder_stops_the_save_in_one_line(engine, tmp_path):
    """Ranks of another node with a node-local output folder: rank 0's temporary folder is not there, which
    failed with FileNotFoundError on those ranks while the others waited. Seen from such a rank (rank 1 of a
    world whose collectives are this process's own): one line, nothing written."""
    from alignrl.runtime.env import DistEnv

    eng, tok = engine
    root = tmp_path / "node-local" / "checkpoints"
    with pytest.raises(CheckpointError, match="is not shared by all ranks .* every node mounts") as e:
        save_checkpoint(root, 1, {"model": eng}, tok, {}, keep=1, env=DistEnv(rank=1))
    assert "\n" not in str(e.value) and not root.exists()


def test_non_finite_weights_are_never_written(engine, tmp_path):
    eng, tok = engine
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 2, {"model": eng}, tok, {}, keep=1)
    before = _snapshot(root)
    name, param = next(iter(eng.model.named_parameters()))
    with torch.no_grad():
        param.view(-1)[0] = float("nan")
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(root, 4, {"model": eng}, tok, {}, keep=1)
    msg = str(e.value)
    assert "\n" not in msg and "the model has NaN/inf weights after step 4" in msg and "not saving" in msg
    assert f"the last complete checkpoint is {root / 'global_step_2'}" in msg and name in msg
    assert sorted(p.name for p in root.iterdir()) == ["global_step_2", TRACKER]  # no new folder, no temp
    assert _snapshot(root) == before and (root / TRACKER).read_text() == "2"


def test_preference_save_is_complete_keeps_the_old_folder_and_refuses_nan(tiny_model, tmp_path):
    from alignrl.preference.common import save_hf_folder

    model, tok = tiny_model
    out = tmp_path / "models" / "aligned"
    state = {k: v.clone() for k, v in model.state_dict().items()}
    lines = []
    save_hf_folder(out, model, state, tok, {"eval_results.json": {"run": 1}}, SINGLE, log=lines.append)
    assert manifest_problem(out) is None and lines == []
    save_hf_folder(out, model, state, tok, {"eval_results.json": {"run": 2}}, SINGLE, log=lines.append)
    old = list(out.parent.glob("aligned.previous-*"))
    assert len(old) == 1 and json.loads((old[0] / "eval_results.json").read_text()) == {"run": 1}
    assert len(lines) == 1 and str(old[0]) in lines[0] and "not deleted" in lines[0]
    assert json.loads((out / "eval_results.json").read_text()) == {"run": 2}
    state[next(iter(state))] = torch.full_like(next(iter(state.values())), float("inf"))
    with pytest.raises(CheckpointError, match="the trained model has NaN/inf weights"):
        save_hf_folder(out, model, state, tok, {"eval_results.json": {"run": 3}}, SINGLE, log=lines.append)
    assert json.loads((out / "eval_results.json").read_text()) == {"run": 2} and len(list(out.parent.iterdir())) == 2


# ---------------------------------------------------------------- through the CLI


# Runs the CLI, SIGKILLed by itself just before the manifest of step KILL_AT is written: every other file
# of that checkpoint is on disk, so this is the latest moment a kill can leave it incomplete.
KILLED_CLI = """
import os, signal, sys
import alignrl.train.checkpoint as ck
real = ck.write_manifest
def write_manifest(folder):
    if folder.name == ".global_step_{step}.tmp":
        os.kill(os.getpid(), signal.SIGKILL)
    real(folder)
ck.write_manifest = write_manifest
from alignrl.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _cli(args: list[str], code: str | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": src_path()}
    cmd = [sys.executable, *(["-c", code] if code else ["-m", "alignrl"]), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _weights(run: Path, step: int) -> dict:
    return load_file(run / "checkpoints" / f"global_step_{step}" / "model" / "model.safetensors")


@pytest.mark.slow
def test_killed_mid_checkpoint_resumes_from_the_previous_one_to_identical_weights(tiny_model_dir, tmp_path,
                                                                                   cli_in_process):
    """The run is killed by SIGKILL in its own process; the resume and the fresh start run the CLI in this one."""
    steps = 4
    train_grpo(load_config(None, _overrides(tiny_model_dir, tmp_path, "straight", steps)))

    args = ["train", "grpo", *_overrides(tiny_model_dir, tmp_path, "killed", steps)]
    killed = _cli(args, KILLED_CLI.replace("{step}", "4"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    root = tmp_path / "killed" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [".global_step_4.tmp", "global_step_2", TRACKER]
    # What a copy or a filesystem without atomic renames can leave: the half-written folder under its final
    # name, and a tracker pointing at it. Resume must see through both.
    os.replace(root / ".global_step_4.tmp", root / "global_step_4")
    (root / TRACKER).write_text("4")
    before = _snapshot(root)

    resumed = cli_in_process(*args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "skipped global_step_4 (no manifest.json" in resumed.stdout and "(step 2)" in resumed.stdout
    a, b = _weights(tmp_path / "straight", steps), _weights(tmp_path / "killed", steps)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    rows = [json.loads(x) for x in (tmp_path / "killed" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps + 1)), "each step logged exactly once"
    # the half-written step 4 is kept aside; step 2 stays, one of the max_checkpoints=2 newest complete ones
    assert {x for x in before if x[0].startswith("global_step_4/")} <= _snapshot(root)
    assert manifest_problem(root / "global_step_2") is None and manifest_problem(root / "global_step_4") is None

    # trainer.resume_mode=disable over these checkpoints: says so, starts fresh, deletes nothing (the earlier
    # run's config goes with its checkpoints)
    before, old_config = _snapshot(root), (tmp_path / "killed" / "config.yaml").read_text()
    fresh = cli_in_process("train", "grpo", *_overrides(tiny_model_dir, tmp_path, "killed", 1, 0),
                           "trainer.resume_mode=disable")
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert "trainer.resume_mode=disable: starting fresh; the existing checkpoints (global_step_4, global_step_2)" \
           in fresh.stdout and "resumed from" not in fresh.stdout
    assert before <= _snapshot(root)
    assert sorted(p.name for p in root.glob("global_step_*")) == ["global_step_1"]
    assert [p.read_text() for p in root.glob("previous_run-*/config.yaml")] == [old_config]
    assert (tmp_path / "killed" / "config.yaml").read_text() != old_config  # the new run's (1 step, not 6)


@pytest.mark.slow
def test_non_finite_model_stops_the_cli_with_one_line_and_keeps_the_last_checkpoint(tiny_model_dir, tmp_path):
    """The guard of last resort: whatever made the weights NaN, the save refuses and names the good one."""
    poisoned = """
import sys, torch
import alignrl.train.checkpoint as ck
real = ck.save_checkpoint
def save_checkpoint(root, step, engines, *a, **k):
    if step == 4:
        with torch.no_grad():
            next(engines["model"].model.parameters()).fill_(float("nan"))
    return real(root, step, engines, *a, **k)
import alignrl.runner as runner
runner.save_checkpoint = save_checkpoint
from alignrl.cli import main
sys.exit(main(sys.argv[1:]))
"""
    r = _cli(["train", "grpo", *_overrides(tiny_model_dir, tmp_path, "nan", 4)], poisoned)
    root = tmp_path / "nan" / "checkpoints"
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "the model has NaN/inf weights after step 4" in lines[0]
    assert f"the last complete checkpoint is {root / 'global_step_2'}" in lines[0]
    assert sorted(p.name for p in root.iterdir()) == ["global_step_2", TRACKER]
    assert manifest_problem(root / "global_step_2") is None


@pytest.mark.timeout(120)
def test_a_run_folder_another_process_writes_is_refused_in_one_line(tiny_model_dir, tmp_path):
    """Two runs writing one folder's checkpoints and logs would corrupt each other's: the second stops at once. The
    claim goes with its process, kill -9 included."""
    import subprocess
    import sys

    from alignrl.config import ConfigError
    from alignrl.train.checkpoint import hold_run_dir
    from conftest import src_path

    run = tmp_path / "runs" / "held"
    run.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": src_path(), "OMP_NUM_THREADS": "1"}
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
                               "from alignrl.train.checkpoint import hold_run_dir\nclaim = hold_run_dir(Path(sys.argv[1]))\n"
                               "print('held', flush=True)\ntime.sleep(120)", str(run)], stdout=subprocess.PIPE, text=True,
                              env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"another run \(pid {holder.pid} on .+\) is writing {run}: stop it"):
            hold_run_dir(run)
        done = subprocess.run([sys.executable, "-m", "alignrl", "train", "grpo", f"model.path={tiny_model_dir}",
                               f"trainer.output_dir={run.parent}", "trainer.experiment_name=held",
                               "trainer.total_training_steps=1"], capture_output=True, text=True, env=env, timeout=100)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert f"another run (pid {holder.pid} on" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    finally:
        holder.kill()
        holder.wait()
    assert hold_run_dir(run) is not None and hold_run_dir(run) is not None  # and a process may claim it twice


@pytest.mark.timeout(120)
def test_a_run_that_fails_lets_the_folder_go_while_its_process_lives_on(tiny_model_dir, tmp_path):
    """A notebook or a Ray worker outlives the run: the claim is dropped when the run fails, not at the process's
    exit (another process may then claim the folder)."""
    import subprocess
    import sys

    from alignrl.runner import train_grpo
    from alignrl.config import load_config
    from alignrl.data.loaders import DataError
    from conftest import src_path

    (tmp_path / "bad.jsonl").write_text('{"x": 1}\n')
    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"trainer.output_dir={tmp_path / 'runs'}",
                             "trainer.experiment_name=failed", f"data.train_files={tmp_path / 'bad.jsonl'}"])
    with pytest.raises(DataError, match="cannot tell the data format") as failed:
        train_grpo(cfg)  # fails after it claimed the folder
    # kept, as a notebook keeps its last traceback: its frames (and a claim in them) live on
    assert failed.value.__traceback__ is not None
    probe = subprocess.run([sys.executable, "-c", "import sys\nfrom pathlib import Path\nfrom alignrl.train.checkpoint "
                            "import hold_run_dir\nprint(hold_run_dir(Path(sys.argv[1])) is not None)", str(cfg.run_dir)],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": src_path(), "OMP_NUM_THREADS": "1"})
    assert (probe.returncode, probe.stdout.strip()) == (0, "True"), probe.stderr[-2000:]
