import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# runs started by tests choose their threads from the usable cores alone, not from what the other test process
# happens to be doing: the same thread count, the same float sums, in every run
os.environ.setdefault("ALIGNRL_IGNORE_LOAD", "1")
# the Ray nodes tests start (and their raylets) never refuse objects or warn on every node for a nearly full
# disk: a shared CI disk is often past Ray's 95%, and these clusters hold a few MB
os.environ.setdefault("RAY_local_fs_capacity_threshold", "1")
SRC = str(Path(__file__).parents[1] / "src")
pytest_plugins = ["vision_fixtures"]  # the vision tests' tiny model and pictures, made once per module


def src_path() -> str:
    """PYTHONPATH for the processes a test starts: the checkout's src first, then the caller's own PYTHONPATH
    (where packages were installed with `pip --target` rather than into the interpreter's environment)."""
    return os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))

# A very small model for pipeline tests: random init, no SFT, built once per session.
TEST_RECIPE = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, tokenizer_corpus=500, sft_steps=0)


def run_group(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """subprocess.run(capture_output, text) in a session of its own: on timeout the whole group (torchrun and its
    ranks) is killed, not only the launcher, so no rank outlives the test. Raises TimeoutExpired as run does."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **kw) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def signal_after(cmd: list[str], marker: str, sig: int, stream: str = "stderr", timeout: float = 60,
                 **kw) -> tuple[int, str, str]:
    """Starts `cmd` in a session of its own, sends it `sig` once a line of `stream` holds `marker` (or the stream
    ends), and returns (exit code, the rest of stdout, the rest of stderr); the whole group is killed if it
    outlives `timeout` after the signal."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         **kw)
    try:
        for line in getattr(p, stream):
            if marker in line:
                break
        p.send_signal(sig)
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
    return p.returncode, out, err


@pytest.fixture(autouse=True)
def program_names_stay_in_their_test(monkeypatch):
    """The seed scripts' mains set the program name and flag names for the processes they start; called in-process
    by a test, they would rename every later test's errors."""
    for var in ("ALIGNRL_PROG", "ALIGNRL_FLAG_NAMES"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)  # recorded: whatever the test sets is removed after it


# what torchrun sets for each rank; `alignrl train` reads them to know it already runs as a launched rank
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def launch_variables_stay_in_their_test():
    """A one-process DeepSpeed engine sets LOCAL_RANK for DeepSpeed to read, and leaves it: a later test's in-process
    `alignrl train` would take itself for a torchrun rank, skip its launch checks and train in the working folder.
    Each test ends with the launch variables it started with, whatever the order the test files run in."""
    before = {name: os.environ.get(name) for name in LAUNCH_VARS}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# top-level names alignrl provides modules under (verl's APIs for users' files), or a test's recipe package takes
PROVIDED_ROOTS = ("verl", "recipe")


@pytest.fixture(autouse=True)
def provided_modules_stay_in_their_test():
    """Modules a test registered under verl's names (alignrl's provided APIs, a recipe package of a test's folder)
    are removed after it, and the ones before it put back: a later test in the same process starts as a fresh process
    does, whatever the order the test files run in."""
    def ours(name: str) -> bool:
        return name.split(".", 1)[0] in PROVIDED_ROOTS

    before = {name: module for name, module in sys.modules.items() if ours(name)}
    yield
    for name in [n for n in sys.modules if ours(n) and sys.modules[n] is not before.get(n)]:
        del sys.modules[name]
        parent, _, leaf = name.rpartition(".")
        if parent in before and leaf in vars(before[parent]):  # the submodule set as its parent's attribute
            delattr(before[parent], leaf)
    sys.modules.update(before)
    for name, module in before.items():  # as the import system links a submodule to its package
        parent, _, leaf = name.rpartition(".")
        if parent in before:
            setattr(before[parent], leaf, module)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from alignrl.models.tiny import TinyRecipe, build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("models") / "tiny", TinyRecipe(**TEST_RECIPE), log=lambda *_: None)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from alignrl.models.loader import load_model

    return load_model(str(tiny_model_dir))


@pytest.fixture(scope="session")
def model_services(tiny_model_dir):
    """A generation and a reference service of the tiny model, shared by the tests that train through them:
    every run pushes its own start-up weights to the generation service first."""
    from alignrl.serve.process import ServiceProcess

    with ServiceProcess(["generate", "--model", str(tiny_model_dir)]) as gen, \
            ServiceProcess(["ref", "--model", str(tiny_model_dir)]) as ref:
        yield gen, ref


@pytest.fixture(scope="session")
def base_generation(tiny_model_dir):
    """A generation service that keeps the tiny model's own weights (no test trains through it), for the tests
    that compare what it generates with local generation."""
    from alignrl.serve.process import ServiceProcess

    with ServiceProcess(["generate", "--model", str(tiny_model_dir)]) as gen:
        yield gen


def json_reply(handler, obj, code: int = 200) -> None:
    """An http.server handler's JSON answer."""
    import json

    body = json.dumps(obj).encode()
    handler.send_response(code)
    handler.send_header("content-type", "application/json")
    handler.send_header("content-length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@pytest.fixture(scope="session")
def retrieval_stub():
    """The URL of a Search-R1 /retrieve endpoint that answers every query with one passage (a thread of this
    process): for runs whose tool must answer but whose searches are not the test's subject."""
    import http.server
    import json
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            queries = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))["queries"]
            json_reply(self, {"result": [[{"document": {"contents": f'"Stub"\nabout {q}'}, "score": 1.0}]
                                         for q in queries]})

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/retrieve"
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def cli_in_process(capsys):
    """`alignrl ...` as `alignrl.cli.main(argv)` in this process, as a CompletedProcess. Where a test
    family checks a user error's one line through the CLI, one case runs the real `python -m alignrl`
    process (what a user's terminal shows, import-time warnings included) and the rest run here: a new
    interpreter costs ~5 s of torch and transformers imports on this machine, the error path is the same."""
    import torch

    from alignrl.cli import main

    def run(*argv: str) -> subprocess.CompletedProcess:
        threads = torch.get_num_threads()  # trainer.threads sets this process's
        try:
            code = main(list(argv))
        finally:
            torch.set_num_threads(threads)
        got = capsys.readouterr()
        return subprocess.CompletedProcess(["alignrl", *argv], code, got.out, got.err)

    return run


RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
RAY_NODE = dict(num_cpus=8, num_gpus=8, node_ip_address="127.0.0.1", include_dashboard=False,
            object_store_memory=80 << 20)


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes × 8 fake GPUs on this machine, as in seed 001 (`ray.cluster_utils.Cluster`, bound to
    127.0.0.1), for the module; shut down after it."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    # Ray turns a loopback address into the machine's own IP unless clusters are "local only"; the
    # nodes here listen on 127.0.0.1, so every process of the test (and its drivers) keeps loopback.
    from ray._private import ray_constants

    if ray.is_initialized():  # a Ray an earlier test in this process started implicitly (ray.get_gpu_ids, ...)
        ray.shutdown()
    saved = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(RAY_LOOPBACK_ENV)
    ray_constants.ENABLE_RAY_CLUSTER, os.environ[RAY_LOOPBACK_ENV] = False, "0"
    c = Cluster(initialize_head=True, head_node_args=dict(RAY_NODE))
    try:
        c.add_node(**RAY_NODE)
        c.wait_for_nodes()
        ray.init(address=c.address, logging_level="ERROR")
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = saved[0]
        if saved[1] is None:
            os.environ.pop(RAY_LOOPBACK_ENV, None)
        else:
            os.environ[RAY_LOOPBACK_ENV] = saved[1]


@pytest.fixture(scope="session")
def vl_run(tmp_path_factory):
    """(tiny VL folder, LMM-R1 data file, reward spec) for the runs with images of test_vision_placements and
    test_ray_runs: read only, so made once for both."""
    from alignrl.models.tiny_vl import build_tiny_vl
    from visionrows import REWARD, color_rows, save_pictures, write_jsonl

    root = tmp_path_factory.mktemp("vl_run")
    folder = build_tiny_vl(root / "tiny-vl", seed=0)
    write_jsonl(root / "train.jsonl", color_rows(save_pictures(root)))
    (root / "reward.py").write_text(REWARD)
    return folder, root / "train.jsonl", f"{root / 'reward.py'}:compute_score"


@pytest.fixture
def http_servers():
    """Starts stand-in HTTP servers, `start(handler class) -> http://127.0.0.1:<free port>`; all stopped at the end."""
    import threading
    from http.server import ThreadingHTTPServer

    servers = []

    def start(handler) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def pytest_collection_modifyitems(config, items):
    """Heaviest test files first (tests/file_seconds.json; `make test` turns xdist's own order, by test count, off):
    the two test processes then end together instead of one running a two-minute file alone at the end. A stable
    sort: each file's tests keep their order, and files not listed keep theirs, after the listed ones."""
    import json

    seconds = json.loads((Path(__file__).parent / "file_seconds.json").read_text())
    items.sort(key=lambda item: -seconds.get(item.path.name, 0))


def pytest_configure(config):
    """One port pool for the whole run, named before the test processes start so they and every process they start
    share it: two tests never get the same port, and none is one the kernel hands out (an outgoing connection of a
    Ray test in the other process took a port a trainer had been given before it could bind it)."""
    from alignrl.runtime.ports import POOL_ENV, pool_range

    if POOL_ENV not in os.environ and pool_range() is not None:
        config.port_pool = tempfile.mkdtemp(prefix="alignrl-ports-", dir="/tmp")
        os.environ[POOL_ENV] = os.path.join(config.port_pool, "pool")  # made by the first process to take a port


def pytest_unconfigure(config):
    import shutil

    from alignrl.runtime.ports import POOL_ENV

    if getattr(config, "port_pool", None):
        os.environ.pop(POOL_ENV, None)
        shutil.rmtree(config.port_pool, ignore_errors=True)


def pytest_sessionfinish(session, exitstatus):
    """Tests kill whole process groups (a trainer with its resource tracker): their shared-memory segments would stay
    in /dev/shm until the next trainer on this machine sweeps them."""
    from alignrl.wire import shm_segments

    shm_segments.sweep()


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
    return lines[0]


@pytest.fixture
def trainer(tmp_path, monkeypatch):
    """training_worker.py's main in `tmp_path`, with the launch replaced: (exit code, the trainer's overrides or
    None when nothing was launched, stderr)."""
    from alignrl import cli
    from alignrl.runtime import launch
    from alignrl.compat import zmq_pipeline as seed004

    monkeypatch.chdir(tmp_path)
    # training_main sets them; restored after the test
    for var in ("CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR", "ALIGNRL_PROG"):
        monkeypatch.setenv(var, os.environ.get(var, ""))
        monkeypatch.delenv(var)
    launched = []
    monkeypatch.setattr(launch, "torchrun", lambda nproc, argv, *a, **k: launched.append(argv) or 0)
    monkeypatch.setattr(cli, "main", lambda argv: launched.append(argv) or 0)

    def run(argv, capsys):
        launched.clear()
        try:
            code = seed004.training_main([str(x) for x in argv])
        except SystemExit as e:
            code = e.code
        ran = launched[-1][launched[-1].index("grpo") + 1:] if launched else None
        return code, ran, capsys.readouterr().err

    return run


# ---------------------------------------------------------------- a few GRPO steps of the tiny model, in process

SMALL_GRPO = ["data.train_size=32", "data.val_size=4", "data.val_size_during_training=4", "data.train_batch_size=2",
              "rollout.n=2", "rollout.max_new_tokens=6", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=4",
              "actor.lr=1e-2", "actor.entropy_coeff=0.05", "trainer.test_freq=0", "trainer.progress_bar=false",
              "trainer.logger=[jsonl]"]


def small_grpo(model_dir, *extra: str):
    """The config of a GRPO run of seconds (SMALL_GRPO) on the model in `model_dir`, `extra` overrides on top."""
    from alignrl.config import load_config

    return load_config(None, [*SMALL_GRPO, f"model.path={model_dir}", *extra])


def run_settings(out: Path, name: str, steps: int) -> list[str]:
    """The overrides that put a run of `steps` steps in `out/name`."""
    return [f"trainer.output_dir={out}", f"trainer.experiment_name={name}", f"trainer.total_training_steps={steps}"]


def checkpoint_dir(out: Path, name: str, step: int) -> Path:
    """The checkpoint of `step` of the run in `out/name`."""
    return out / name / "checkpoints" / f"global_step_{step}"


def recording_copy(cfg, model_dir):
    """The actor of `cfg` on the model in `model_dir`, and an in-process rollout engine on a copy of that model, joined
    by the copy sink the in-process placement uses (checked to be a MergedCopy): (actor, the engine's model, sink,
    the names each load of the engine received, in order)."""
    from alignrl.models.loader import frozen_copy, load_model
    from alignrl.placements.build import build_actor
    from alignrl.placements.weight_sync import MergedCopy, copy_sink
    from alignrl.rollout.hf_engine import HFRolloutEngine
    from alignrl.runtime.env import SINGLE

    model, tokenizer = load_model(str(model_dir))
    copy = frozen_copy(model)
    actor = build_actor(cfg, model, None, SINGLE)
    engine = HFRolloutEngine(copy, tokenizer)
    sent: list[list[str]] = []
    load = engine.load_weights

    def record(named):
        named = list(named)
        sent.append([n for n, _ in named])
        load(named)

    engine.load_weights = record
    sink = copy_sink(actor, engine, SINGLE)
    assert isinstance(sink, MergedCopy)
    return actor, copy, sink, sent


# ---------------------------------------------------------------- seed 001's Ray scripts on this machine

PY_BIN = str(Path(sys.executable).parent)  # where this interpreter's `ray` and `alignrl` are
# a node's agents, each on a port of its own: on their fixed defaults (52365, ...) they fail to bind while another
# Ray of the test run holds them, and the node then takes no job ("No available agent to submit job")
RAY_AGENT_VARS = ("RAY_AGENT_PORT", "RAY_AGENT_GRPC_PORT", "RAY_RUNTIME_ENV_AGENT_PORT", "RAY_METRICS_PORT")


def run_captured(args, env, timeout=120, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def run_until_agent(args, env, timeout, cwd=None) -> subprocess.CompletedProcess:
    """`args` (a `ray job submit`, or a script that makes one), again while the head says its job agent is not up yet:
    on a loaded machine the dashboard can answer before the head node's agent has registered ("No available agent to
    submit job, please try again later"), and a submission that fails so has not created its submission id."""
    deadline = time.time() + 90
    while True:
        out = run_captured(args, env, timeout, cwd)
        if out.returncode == 0 or "No available agent" not in out.stdout + out.stderr or time.time() > deadline:
            return out
        time.sleep(3)


class TwoRayNodes:
    """The environments of start_ray_cluster.sh's head and worker on this machine: the GCS on ports[0], the
    dashboard on ports[1], each node's agents on ports of their own (ports[2:6], ports[6:10]), `extra` more free
    ports for the test from ports[10]; their temp dirs under `short`, a folder of /tmp (Ray's socket paths must stay
    under 108 bytes) that the test removes."""

    def __init__(self, prefix: str, extra: int = 0):
        from alignrl.runtime.ports import free_ports

        self.ports = free_ports(10 + extra)
        self.short = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        self.base = {**os.environ, "PATH": f"{PY_BIN}:{os.environ['PATH']}", "RAY_PORT": str(self.ports[0]),
                     "RAY_DASHBOARD_PORT": str(self.ports[1]), "ALIGNRL_CPU_SLOTS": "4", "PYTHONPATH": src_path(),
                     "OMP_NUM_THREADS": "1"}
        self.base.pop("RAY_ADDRESS", None)
        self.head = {**self.base, "RAY_TEMP_DIR": str(self.short / "head"),
                     **dict(zip(RAY_AGENT_VARS, map(str, self.ports[2:6])))}
        self.worker = {**self.base, "RAY_TEMP_DIR": str(self.short / "worker"),
                       **dict(zip(RAY_AGENT_VARS, map(str, self.ports[6:10])))}

    def stop(self, script: Path) -> None:
        """`script stop` (start_ray_cluster.sh) on the worker, then on the head."""
        for env in (self.worker, self.head):
            run_captured(["bash", str(script), "stop"], env)
