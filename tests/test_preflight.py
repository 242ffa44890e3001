"""Preflight and one-line user errors, through the command line as a user meets them: exit code 2, one
line on stderr naming the file / key / row, no traceback, no argparse usage block; `--nproc`, the launch
scripts and torchrun ranks report a bad batch split once; servers check their port before loading a
model and say `listening` only when they accept connections."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import src_path

REPO = Path(__file__).resolve().parents[1]
BAD_SPLIT = ["data.train_batch_size=3", "actor.ppo_mini_batch_size=3", "actor.ppo_micro_batch_size=8"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "ALIGNRL_API_KEY")}
    env.update(PYTHONPATH=src_path(), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def _run(cmd: list[str], cwd: Path = REPO, env: dict | None = None,
         timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env={**_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def _alignrl(*args: str, **kw) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "alignrl", *args], **kw)


def _one_line_error(p: subprocess.CompletedProcess, *fragments: str) -> str:
    """The single stderr line of a user error, checked for the contract and the given fragments."""
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "usage:" not in p.stderr, p.stderr[-3000:]
    assert len(lines) == 1, p.stderr[-3000:]
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------- config and flags


def test_scalar_given_to_a_section_names_it(tmp_path):
    _one_line_error(_alignrl("config", "actor=5"), "'actor' is a config section", "actor.lr=")
    f = tmp_path / "c.yaml"
    f.write_text("rollout:\n  n: 2\nactor: 5\n")
    _one_line_error(_alignrl("config", "--config", str(f)), str(f), "'actor' is a config section")


def test_non_utf8_byte_in_config_names_its_line(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_bytes(b"actor:\n  lr: 0.1\n  # caf\xe9\nrollout:\n  n: 2\n")
    _one_line_error(_alignrl("config", "--config", str(f)), f"{f}:3:", "0xe9", "UTF-8")


@pytest.mark.parametrize("args, fragment", [
    (["train", "grpo", "--config", "{cfg}", "bogus"], "unrecognized argument 'bogus'"),
    (["train", "grpo", "--config", "{cfg}", "--bogus"], "unrecognized argument '--bogus'"),
    (["train", "grpo", "--config", "{cfg}", "bogus.key=1"], "unknown config key 'bogus"),
    (["train", "nope"], "invalid choice: 'nope'"),
    (["config", "--config"], "expected one argument"),
    (["build-demo-model", "a.b=1"], "takes no overrides"),
    (["train", "grpo", "--nproc", "two"], "--nproc 'two'"),
    (["serve", "generate", "--model", "demo", "--bogus"], "unrecognized arguments: --bogus"),
    (["serve", "retrieve", "--topk", "0"], "--topk must be between"),
    (["doctor", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_cli_user_errors_never_print_the_usage_block(tmp_path, args, fragment):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rollout:\n  n: 2\n")
    _one_line_error(_alignrl(*[a.replace("{cfg}", str(cfg)) for a in args]), fragment)


def test_overrides_may_come_before_or_after_flags(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rollout:\n  n: 2\nactor:\n  lr: 0.5\n")
    p = _alignrl("config", "actor.lr=0.25", "--config", str(cfg), "rollout.top_k=5")
    assert p.returncode == 0, p.stderr
    out = yaml.safe_load(p.stdout)
    assert out["actor"]["lr"] == 0.25 and out["rollout"]["n"] == 2 and out["rollout"]["top_k"] == 5


# ---------------------------------------------------------------- data


def test_missing_val_file_is_blamed_on_data_val_files(tmp_path, cli_in_process):
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    missing = tmp_path / "val.jsonl"
    _one_line_error(cli_in_process("train", "grpo", f"data.train_files={train}", f"data.val_files={missing}",
                                   f"trainer.output_dir={tmp_path / 'out'}"),
                    f"data file not found: {missing}", "set data.val_files")
    assert not (tmp_path / "out").exists(), "nothing is written before the inputs are checked"


@pytest.mark.parametrize("key, where", [("trainer.output_dir", "out"), ("trainer.checkpoint_dir", "out/exp/ckpt"),
                                        ("trainer.log_dir", "out/exp/logs")])
def test_a_run_folder_that_is_a_file_is_refused_before_anything_runs(tmp_path, cli_in_process, key, where):
    """Found here, not as a NotADirectoryError traceback after the first step trained."""
    file = tmp_path / where
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text("a file")
    value = {"trainer.output_dir": file, "trainer.checkpoint_dir": "ckpt", "trainer.log_dir": "logs"}[key]
    out = [f"trainer.output_dir={tmp_path / 'out'}"] if key != "trainer.output_dir" else []
    _one_line_error(cli_in_process("train", "grpo", *out, "trainer.experiment_name=exp", f"{key}={value}"),
                    f"{key}: {file} is a file", f"set {key} to another path")


def test_non_utf8_byte_in_jsonl_names_its_line(tmp_path, cli_in_process):
    good = json.dumps({"question": "what is 1 + 1?", "answer": "#### 2"}).encode() + b"\n"
    data = tmp_path / "train.jsonl"
    # far past the first read buffer of a text-mode file, whose decoding error named an earlier line
    data.write_bytes(good * 300 + b'{"question": "caf\xe9", "answer": "#### 1"}\n' + good)
    _one_line_error(cli_in_process("train", "grpo", f"data.train_files={data}", "model.path=/nonexistent/model",
                                   f"trainer.output_dir={tmp_path / 'out'}"),
                    f"{data}:301: line is not UTF-8 text")


def test_identical_chosen_and_rejected_is_refused_by_row(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    rows = [{"prompt": "2+2?", "chosen": "4", "rejected": "5"}, {"prompt": "1+1?", "chosen": "2", "rejected": "2"}]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _one_line_error(_alignrl("train", "rm", "--task", "helpful", f"helpful_train_file={pairs}",
                             f"--output_dir={tmp_path / 'rm'}", timeout=180),
                    f"{pairs}:2: chosen and rejected are the same text")


def test_identical_pku_responses_are_refused_by_row(tmp_path):
    from alignrl.data.loaders import DataError
    from alignrl.data.preference import load_pairs

    pairs = tmp_path / "pku.jsonl"
    pairs.write_text(json.dumps({"prompt": "hi", "response_0": "same", "response_1": "same",
                                 "better_response_id": 0, "safer_response_id": 1}) + "\n")
    with pytest.raises(DataError, match=r"pku.jsonl:1: response_0 and response_1 are the same text"):
        load_pairs(str(pairs))


# ---------------------------------------------------------------- launches


@pytest.mark.timeout(120)
def test_nproc_checks_the_batch_split_before_starting_ranks():
    t0 = time.monotonic()
    line = _one_line_error(_alignrl("train", "grpo", "--nproc", "2", *BAD_SPLIT),
                           "data.train_batch_size=3 must be a multiple of the world size 2")
    assert line.startswith("alignrl: error:")
    assert time.monotonic() - t0 < 60


@pytest.mark.timeout(180)
def test_ranks_report_a_user_error_once():
    """What a user's torchrun sees from the ranks (rank 0 speaks), and our agent adds nothing to it."""
    from alignrl.runtime.ports import free_port

    raw = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                "-m", "alignrl", "train", "grpo", *BAD_SPLIT], timeout=150)
    assert raw.returncode != 0 and raw.stderr.count("alignrl: error:") == 1, raw.stderr[-3000:]
    agent = _run([sys.executable, "-m", "alignrl.runtime.launch", "--nproc_per_node=2", f"--master_port={free_port()}",
                  "-m", "alignrl", "train", "grpo", *BAD_SPLIT], timeout=150)
    _one_line_error(agent, "must be a multiple of the world size 2")


def test_nproc_rendezvous_port_is_the_given_one_else_master_port_else_a_free_one(monkeypatch):
    from alignrl.runtime import launch

    seen = []
    monkeypatch.setattr(launch, "agent", lambda argv, fork=False: seen.append(argv) or 0)
    monkeypatch.setenv("MASTER_PORT", "29611")
    launch.torchrun(2, ["alignrl", "train", "grpo"], master_port=29622)
    launch.torchrun(2, ["alignrl", "train", "grpo"])
    monkeypatch.delenv("MASTER_PORT")
    launch.torchrun(2, ["alignrl", "train", "grpo"])
    ports = [next(a for a in cmd if a.startswith("--master_port=")) for cmd in seen]
    assert ports[:2] == ["--master_port=29622", "--master_port=29611"] and ports[2] not in ports[:2]


def test_nproc_takes_trainer_master_port_only_where_the_file_or_the_command_line_sets_it(tmp_path):
    from alignrl import cli

    def port(*argv):
        args = cli._parse(["train", "grpo", *argv])
        return cli._port_given(args, cli.load_config(cli._config_path(args), args.overrides))

    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("trainer:\n  master_port: 29633\n")
    assert port() is None  # the default 29500 is never forced on two runs of one machine
    assert port("--config", str(cfg_file)) == 29633
    assert port("--config", str(cfg_file), "trainer.master_port=29644") == 29644
    assert port("training.master_port=29655") == 29655  # seed 000's spelling


@pytest.mark.timeout(120)
def test_taken_rendezvous_port_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        p = _alignrl("train", "grpo", "--nproc", "2", f"trainer.master_port={port}")  # used when given
    _one_line_error(p, f"torchrun rendezvous at 127.0.0.1:{port} failed", "pick a free port")


def test_taken_master_port_under_another_launcher_is_one_line(tmp_path, cli_in_process, monkeypatch):
    """A launcher that is not ours (DeepSpeed's, a scheduler's) sets RANK / MASTER_PORT itself: rank 0's
    rendezvous failure is one line, not a DistNetworkError traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"),
                           ("MASTER_PORT", str(port))):
            monkeypatch.setenv(key, value)
        p = cli_in_process("train", "grpo", "trainer.strategy=ddp", f"trainer.output_dir={tmp_path}")
    _one_line_error(p, f"rank 0: the process group's rendezvous at 127.0.0.1:{port} failed", "pick a free port")


@pytest.mark.timeout(180)
def test_launch_script_checks_config_and_world_size_first(tmp_path):
    if not shutil.which("bash"):
        pytest.skip("no bash")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(yaml.safe_dump({"training": {"master_node": "127.0.0.1", "master_port": 29500,
                                                  "hostfile": str(hostfile)},
                                     "models": {"train": {"path": "demo"}, "output": {"path": str(tmp_path / "o")}}}))
    env = {"CONFIG": str(nodes), "ALIGNRL": str(Path(sys.executable).parent / "alignrl")}
    p = _run(["bash", "scripts/launch_distributed.sh", *BAD_SPLIT], env=env)
    _one_line_error(p, "launch_distributed.sh:", "must be a multiple of the world size 2")
    p = _run(["bash", "scripts/launch_distributed.sh", "actor=5"], env=env)
    _one_line_error(p, "'actor' is a config section")
    p = _run(["bash", "scripts/train_rm_distributed.sh", "helpful", "2", "max_train_pairs=3"], timeout=150)
    _one_line_error(p, "fewer than one global batch")


# ---------------------------------------------------------------- servers


@pytest.mark.timeout(120)
@pytest.mark.parametrize("service", ["generate", "ref", "reward"])
def test_taken_port_fails_before_the_model_loads(service, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        # a model path that does not exist: the port is checked first, so the port is what is reported
        p = _alignrl("serve", service, "--model", str(tmp_path / "no-model"), "--port", str(port))
    _one_line_error(p, f"cannot bind 127.0.0.1:{port}", "Address already in use")
    assert "listening" not in p.stderr


@pytest.mark.timeout(180)
def test_listening_is_said_only_once_the_server_answers(tiny_model_dir):
    proc = subprocess.Popen([sys.executable, "-m", "alignrl", "serve", "ref", "--model", str(tiny_model_dir),
                             "--host", "127.0.0.1", "--port", "0"], env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert "alignrl serve ref: listening on http://127.0.0.1:" in line, line
        url = line.split("listening on ")[1].split()[0]
        assert not url.endswith(":0"), "the bound port is reported, not the one asked for"
        assert httpx.get(url + "/health", timeout=10).json() == {"status": "healthy"}
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_collective_that_lost_its_peer_is_told_apart(monkeypatch):
    """gloo says only in its text that another rank went away: that rank's death is the story, not this
    rank's traceback (the CLI prints one line for it)."""
    from alignrl.runtime.launch import peer_lost

    lost = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:32405. GLHF!")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not peer_lost(lost)  # one process: nothing of the kind
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert peer_lost(lost) and peer_lost(RuntimeError("Connection reset by peer"))
    assert not peer_lost(RuntimeError("CUDA out of memory")) and not peer_lost(ValueError("Broken pipe"))


@pytest.mark.parametrize("argv, prefix", [
    (["train", "ppo-ray", "--advantage_estimator", "rloo"], ""), (["sample", "--data-port", "abc"], ""),
    (["train", "rm", "--bogus"], "alignrl: error:"), (["train", "dpo", "beta=-1"], "alignrl: error:"),
    (["train", "dpo", "--loss_type", "kto"], "alignrl: error:"),
    (["train", "rm", "report_to=[mlflow]"], "alignrl: error:"),
    (["sample", "--data-port", "99999"], "alignrl sample: error: --data-port 99999 is not a TCP port"),
    (["sample", "--sync-port", "5555"], "alignrl sample: error: --data-port and --sync-port are both 5555"),
    (["sample", "--host", "not..a..host"], "alignrl sample: error: --host 'not..a..host' does not resolve"),
    (["sample", "--peer-timeout", "0"], "alignrl sample: error: --peer-timeout 0:")])
def test_a_flag_mistake_answers_before_torch_is_imported(argv, prefix):
    """A mistyped flag, key or value is said at once: importing torch, Ray and transformers first took 4-10 s of CPU
    here."""
    code = ("import sys\nfrom alignrl.cli import main\ntry:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    rc = e.code\nprint(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["2", "False"], out.stdout + out.stderr
    assert out.stderr.strip().count("\n") == 0 and "error:" in out.stderr and out.stderr.startswith(prefix), out.stderr


@pytest.mark.parametrize("argv, message", [
    (["--data-port", "99999"], "training_worker.py: error: --data-port 99999 is not a TCP port"),
    (["--sync-port", "5555"], "training_worker.py: error: --data-port and --sync-port are both 5555"),
    (["actor.lr=abc"], "training_worker.py: error: bad value for 'actor.lr'"),
    (["--nproc", "0"], "training_worker.py: error: --nproc 0")])
def test_training_worker_names_a_mistake_before_it_writes_deepspeed_json(tmp_path, argv, message):
    """Seed 004's trainer generates deepspeed.json in the folder it runs in; a mistaken flag leaves nothing there."""
    script = Path(__file__).resolve().parents[1] / "training_worker.py"
    out = subprocess.run([sys.executable, str(script), *argv], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and out.stderr.startswith(message) and out.stderr.count("\n") == 1, out.stderr
    assert not (tmp_path / "deepspeed.json").exists()
