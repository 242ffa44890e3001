"""Seed 004's command lines as its users type them: communication_test.py between two processes on the given
ports, one-line answers to bad input, deepspeed.json's batch numbers followed (and checked) by the trainer,
run_distributed.py's --help and checks, the sampler's --data-path, and the seed's checkpoint interval. Every
process a test starts runs in a session of its own and is stopped by its PID."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from alignrl.runtime.ports import free_ports
from conftest import SRC, one_line, run_group, src_path

ROOT = Path(SRC).parent
PASSED_ON = ("--no-deepspeed", "--data-path", "--max-steps", "--output-dir", "--max-staleness", "--batch-size",
             "--group-size", "--lr", "--save-steps", "--threads", "--eval-data-path")


def script(name: str, *args, cwd, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": src_path(), "OMP_NUM_THREADS": "1"}
    return run_group([sys.executable, str(ROOT / name), *map(str, args)], timeout, cwd=cwd, env=env)


def ctrl_c_as_in_a_terminal() -> None:
    """SIGINT as a terminal's foreground process has it: a test run started in the background (bash `&`) ignores it,
    and so would the processes it starts (Python installs no KeyboardInterrupt handler for an ignored SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# --- communication_test.py ---------------------------------------------------------------------------------------

@pytest.mark.timeout(240)
def test_communication_test_runs_between_two_processes_on_the_given_ports(tiny_model_dir, tmp_path):
    data, sync = free_ports(2)
    out = script("communication_test.py", "--model-path", tiny_model_dir, "--data-port", data, "--sync-port", sync,
                 "--rounds", 2, cwd=tmp_path, timeout=200)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("two processes:"))
    assert f"bound tcp://127.0.0.1:{data} (--data-port) and tcp://127.0.0.1:{sync} (--sync-port)" in line, line
    pids = [int(w) for w in line.replace(",", " ").split() if w.isdigit()]
    assert len(pids) == 2 and pids[0] != pids[1], line  # the trainer side and a second process, the sampler side
    # the seed's schema: reference log-probs are an ndarray, made by the sampler side
    assert "ref_policy_log_probs: numpy.ndarray float32" in out.stdout, out.stdout
    # the sample printed holds every field of the seed's message
    for field in ("prefix_token_ids", "generated_token_ids", "whole_token_ids", "is_finished", "reward_info",
                  "old_policy_log_probs: numpy.ndarray", "ref_policy_log_probs", "MiB/s", "communication_test: OK"):
        assert field in out.stdout, field


@pytest.mark.timeout(120)
@pytest.mark.parametrize("taken", ["data", "sync"])
def test_communication_test_fails_in_one_line_on_a_port_another_program_holds(tmp_path, taken):
    data, sync = free_ports(2)
    port = data if taken == "data" else sync
    with socket.socket() as other:  # another program, not ZeroMQ, on one of the two ports
        other.bind(("127.0.0.1", port))
        other.listen()
        out = script("communication_test.py", "--data-port", data, "--sync-port", sync, "--rounds", 1, cwd=tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    line = one_line(out.stderr)
    assert line.startswith(f"communication_test: FAILED: port {port} on 127.0.0.1 (--{taken}-port) is taken"), line
    assert "communication_test: OK" not in out.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv, said", [
    (["--rounds", "0"], "--rounds 0: give the number of timed round trips, 1 or more"),
    (["--rounds", "-1"], "--rounds -1: give the number of timed round trips, 1 or more"),
    (["--model-path", "/nonexistent"], "--model-path /nonexistent: not a Hugging Face model folder"),
    (["--data-port", "99999"], "--data-port 99999 is not a TCP port"),
    (["--data-port", "5556"], "--data-port and --sync-port are both 5556"),
    (["--timeout", "0"], "--timeout 0: give the seconds")])
def test_communication_test_names_bad_input_in_one_line(tmp_path, argv, said):
    out = script("communication_test.py", *argv, cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert one_line(out.stderr).startswith(f"communication_test.py: error: {said}")


@pytest.mark.timeout(120)
def test_the_sampler_side_says_in_one_line_that_nothing_answers(tiny_model_dir, tmp_path):
    data, sync = free_ports(2)  # nobody listens there
    env = {**os.environ, "PYTHONPATH": src_path(), "OMP_NUM_THREADS": "1"}
    out = run_group([sys.executable, "-m", "alignrl.compat.zmq_comm_test", "--model-path", str(tiny_model_dir),
                     "--data-port", str(data), "--sync-port", str(sync), "--timeout", "2"], 100, cwd=tmp_path, env=env)
    assert out.returncode == 1
    assert one_line(out.stderr).startswith(f"nothing answers on tcp://127.0.0.1:{sync} (--sync-port) within 2 s")


# --- deepspeed.json ----------------------------------------------------------------------------------------------

def _effective(overrides: list[str]) -> str:
    from alignrl.runner import describe_batch
    from alignrl.config import load_config

    return describe_batch(load_config(None, overrides), 1).split("effective batch = ")[1]


def test_the_generated_deepspeed_json_carries_the_runs_batch(trainer, tmp_path, capsys):
    code, overrides, err = trainer(["--batch-size", 2, "--group-size", 4, "actor.ppo_micro_batch_size=2"], capsys)
    assert code == 0 and overrides is not None, err
    ds = json.loads((tmp_path / "deepspeed.json").read_text())
    batch = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    assert [ds[k] for k in batch] == [8, 2, 4], ds
    assert _effective(overrides).startswith("2 sequences/micro-batch × 1 rank(s) × 4 accumulation step(s)")
    assert "train_batch_size 8 = 2 per micro-batch × 1 process(es) × 4 accumulation step(s)" in err
    # run again with the file as written: nothing to say, nothing changed
    code, again, err = trainer(["--batch-size", 2, "--group-size", 4, "actor.ppo_micro_batch_size=2"], capsys)
    assert code == 0 and again == overrides and err == ""
    # the seed's path: one process first, then several; the file nobody edited is written again for the new run
    code, _, err = trainer(["--batch-size", 2, "--group-size", 4, "actor.ppo_micro_batch_size=2", "--nproc", 2], capsys)
    assert code == 0 and "train_batch_size 8 = 2 per micro-batch × 2 process(es) × 2 accumulation step(s)" in err, err
    # once edited it is the user's: the run follows it, or says in one line why it cannot
    ds = json.loads((tmp_path / "deepspeed.json").read_text())
    (tmp_path / "deepspeed.json").write_text(json.dumps({**ds, "zero_optimization": {"stage": 1}}))
    code, _, err = trainer(["--batch-size", 2, "--group-size", 4, "actor.ppo_micro_batch_size=2"], capsys)
    assert code == 2 and "train_batch_size 8 is not train_micro_batch_size_per_gpu 2 × gradient_accumulation_steps 2 × " \
                         "1 training process = 4" in err, err


@pytest.mark.parametrize("ds, effective", [
    ({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4},
     "1 sequences/micro-batch × 1 rank(s) × 4 accumulation step(s)"),
    ({"train_micro_batch_size_per_gpu": 2}, "2 sequences/micro-batch × 1 rank(s) × 2 accumulation step(s)"),
    ({"gradient_accumulation_steps": 4}, "1 sequences/micro-batch × 1 rank(s) × 4 accumulation step(s)")])
def test_the_batch_numbers_of_an_edited_deepspeed_json_are_the_runs(trainer, tmp_path, capsys, ds, effective):
    """The seed: lower the batch in deepspeed.json when memory runs out. Its micro-batch is actor.ppo_micro_batch_size,
    and one line at start says which values came from the file."""
    (tmp_path / "deepspeed.json").write_text(json.dumps({**ds, "zero_optimization": {"stage": 2}}))
    code, overrides, err = trainer(["--batch-size", 1, "--group-size", 4], capsys)
    assert code == 0 and overrides is not None, err
    assert _effective(overrides).startswith(effective)
    line = one_line(err)
    assert line.startswith("training_worker: deepspeed.json: ") and "-> actor.ppo_micro_batch_size=" in line, line


def test_a_deepspeed_train_batch_size_sets_the_mini_batch(trainer, tmp_path, capsys):
    """32 prompts a step (the default) × 4 samples; the file makes it two optimizer steps of 64 sequences."""
    (tmp_path / "deepspeed.json").write_text(json.dumps({"train_batch_size": 64}))
    code, overrides, err = trainer(["--group-size", 4], capsys)
    assert code == 0 and "actor.ppo_mini_batch_size=16" in overrides, (overrides, err)
    assert "train_batch_size 64 -> actor.ppo_mini_batch_size=16" in one_line(err)


@pytest.mark.parametrize("ds, argv, said", [
    ({"zero_optimization": {"stage": 7}}, [], "zero_optimization.stage 7: DeepSpeed's ZeRO stages are 0, 1, 2 and 3"),
    ({"zero_optimization": {"stage": "2"}}, [], "zero_optimization.stage \"2\": DeepSpeed's ZeRO stages"),
    ({"zero_optimization": 2}, [], "zero_optimization must be an object"),
    ({"bf16": {"enabled": "yes"}}, [], "bf16 {\"enabled\": \"yes\"}: give an object like"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, [], "bf16 and fp16 are both enabled"),
    ({"gradient_clipping": -1}, [], "gradient_clipping -1: give the largest gradient norm"),
    ({"train_micro_batch_size_per_gpu": 0}, [], "train_micro_batch_size_per_gpu 0: give a whole number"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}, [], "zero_optimization.offload_optimizer"),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1},
     ["--batch-size", 4, "--group-size", 4],
     "train_batch_size 16 is not train_micro_batch_size_per_gpu 4 × gradient_accumulation_steps 1 × 1 training "
     "process = 4"),
    ({"train_batch_size": 6}, ["--batch-size", 4, "--group-size", 4], "train_batch_size 6 is not a whole number"),
    ({"train_batch_size": 8}, ["--batch-size", 4, "--group-size", 4],
     "train_batch_size 8 (sequences per optimizer step) differs from the 16 that --batch-size gives"),
    ({"train_micro_batch_size_per_gpu": 2}, ["actor.ppo_micro_batch_size=4"],
     "train_micro_batch_size_per_gpu 2 differs from actor.ppo_micro_batch_size=4"),
    ("{not json", [], "not valid JSON")])
def test_a_wrong_deepspeed_json_is_one_line_before_anything_starts(trainer, tmp_path, capsys, ds, argv, said):
    (tmp_path / "deepspeed.json").write_text(ds if isinstance(ds, str) else json.dumps(ds))
    code, overrides, err = trainer(argv, capsys)
    assert code == 2 and overrides is None, (code, err)
    assert one_line(err).startswith(f"training_worker.py: error: deepspeed.json: {said}")


# run_distributed.py following an edited deepspeed.json's batch in a live run: test_pipeline_zmq's two-rank run


# --- run_distributed.py -------------------------------------------------------------------------------------------

def test_run_distributed_help_lists_the_flags_it_passes_on(capsys):
    from alignrl.compat import zmq_launcher as seed004_launch

    with pytest.raises(SystemExit) as e:
        seed004_launch.launcher_main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for flag in PASSED_ON:
        assert f"\n  {flag}" in out, flag
    assert "key.sub=value" in out and "deepspeed.json" in out


@pytest.mark.parametrize("argv, said", [
    (["--data-port", "99999"], "--data-port 99999 is not a TCP port"),
    (["--sync-port", "0"], "--sync-port 0 is not a TCP port"),
    (["--data-port", "6000", "--sync-port", "6000"], "--data-port and --sync-port are both 6000"),
    (["--host", "not..a..host"], "--host 'not..a..host' does not resolve"),
    (["--batch-size", "0"], "--batch-size 0 is out of range"),
    (["--nproc", "3"], "unrecognized arguments: --nproc (run_distributed.py sets it from --sampling-gpu and "
                       "--training-gpus)"),
    (["--gpu-id=2"], "unrecognized arguments: --gpu-id=2"),
    (["--npro", "3"], "unrecognized arguments: --npro"),  # not abbreviated into the trainer's --nproc
    (["--data-path", "/nonexistent.jsonl"], "--data-path /nonexistent.jsonl: no such file"),
    (["--training-gpus", "1,2,1"], "--training-gpus '1,2,1': device 1 is listed twice"),
    (["--model-path", "/nope"], "--model-path='/nope' is not a Hugging Face model folder")])
def test_run_distributed_checks_once_before_starting_anything(argv, said, capsys, monkeypatch, tmp_path):
    """One line from run_distributed.py itself, not one from the sampler and one from the trainer (Popen would
    raise here: nothing is started)."""
    from alignrl.compat import zmq_launcher as seed004_launch

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(seed004_launch.subprocess, "Popen", None)
    with pytest.raises(SystemExit) as e:
        seed004_launch.launcher_main(argv)
    assert e.value.code == 2
    assert one_line(capsys.readouterr().err).startswith(f"run_distributed.py: error: {said}")


def test_run_distributed_checks_deepspeed_json_before_starting_anything(capsys, monkeypatch, tmp_path):
    from alignrl.compat import zmq_launcher as seed004_launch

    monkeypatch.chdir(tmp_path)
    (tmp_path / "deepspeed.json").write_text(json.dumps({"zero_optimization": {"stage": 7}}))
    monkeypatch.setattr(seed004_launch.subprocess, "Popen", None)
    with pytest.raises(SystemExit) as e:
        seed004_launch.launcher_main(["--training-gpus", "1,2"])
    assert e.value.code == 2
    assert one_line(capsys.readouterr().err).startswith("run_distributed.py: error: deepspeed.json: "
                                                        "zero_optimization.stage 7")


# --- sampling_worker.py --data-path ---------------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, said", [
    ("/nonexistent.jsonl", "--data-path /nonexistent.jsonl: no such file"),
    ("data.txt", "--data-path {}: a .txt file; give a .jsonl, .json or .parquet file"),
    ("folder/", "--data-path {}: a folder; give the training data (.jsonl, .json or .parquet)")])
def test_the_sampler_checks_its_data_path_before_it_connects(tmp_path, name, said):
    """At once, in the flag's name, before torch and the model are loaded and before a trainer is asked (it was
    read only once a trainer answered, and named data.train_files)."""
    path = tmp_path / name if not name.startswith("/") else Path(name)
    if name.endswith("/"):
        path.mkdir()
    elif not name.startswith("/"):
        path.write_text("1+1\n")
    code = ("import sys\nfrom alignrl.compat.zmq_pipeline import sampling_main\ntry:\n    rc = sampling_main(sys.argv[1:])\n"
            "except SystemExit as e:\n    rc = e.code\nprint(rc, 'torch' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": src_path()}
    data, sync = free_ports(2)  # nobody listens: the old sampler waited --peer-timeout, then named no file
    out = run_group([sys.executable, "-c", code, "--data-path", str(path), "--data-port", str(data), "--sync-port",
                     str(sync), "--peer-timeout", "2"], 100, cwd=tmp_path, env=env)
    assert out.stdout.split() == ["2", "False"], out.stdout + out.stderr
    assert one_line(out.stderr).startswith(f"sampling_worker.py: error: {said.format(path)}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig, launched", [("SIGINT", False), ("SIGINT", True), ("SIGTERM", False)])
def test_ctrl_c_of_a_sampler_is_one_line_unless_a_launcher_speaks_for_it(tiny_model_dir, tmp_path, sig, launched):
    """A sampler on its own says what Ctrl-C (or `kill`: it said nothing) did; under run_distributed.py
    (ALIGNRL_LAUNCHER) the launcher's one line speaks for it and the trainer."""
    env = {**os.environ, "PYTHONPATH": src_path(), "OMP_NUM_THREADS": "1"}
    if launched:
        env["ALIGNRL_LAUNCHER"] = "run_distributed.py"
    data, sync = free_ports(2)  # no trainer: the sampler waits for one
    with subprocess.Popen([sys.executable, str(ROOT / "sampling_worker.py"), "--model-path", str(tiny_model_dir),
                           "--data-port", str(data), "--sync-port", str(sync)], cwd=tmp_path, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          preexec_fn=ctrl_c_as_in_a_terminal) as p:
        try:
            for line in p.stdout:
                if "waiting for a trainer" in line:
                    break
            if sig == "SIGINT":
                os.killpg(p.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole foreground group
            else:
                os.kill(p.pid, signal.SIGTERM)  # `kill PID`
            out, err = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == (130 if sig == "SIGINT" else 143), err[-3000:]
    if launched:
        assert err.strip() == "", err
    else:
        how = "interrupted" if sig == "SIGINT" else "stopped by SIGTERM"
        assert one_line(err).startswith(f"sampling_worker.py: {how}; the prompts it held go to the next sampler")


# --- the run's own errors --------------------------------------------------------------------------------------------

@pytest.mark.timeout(200)
def test_an_error_inside_the_run_names_training_worker_py(tiny_model_dir, tmp_path):
    """The run itself (torchrun's rank, for DeepSpeed) names the script the user ran, not `alignrl`."""
    (tmp_path / "bad.jsonl").write_text('{"x": 1}\n')
    data, sync = free_ports(2)
    out = script("training_worker.py", "--model-path", tiny_model_dir, "--data-path", "bad.jsonl", "--data-port", data,
                 "--sync-port", sync, cwd=tmp_path, timeout=180)
    assert out.returncode == 2, (out.stdout + out.stderr)[-3000:]
    said = [x for x in out.stderr.splitlines() if not x.startswith("training_worker: wrote deepspeed.json")]
    assert len(said) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert said[0].startswith("training_worker.py: error: bad.jsonl: cannot tell the data format"), said


