"""The Ray driver of `alignrl train ppo-ray <OpenRLHF flags>` and, inside a Ray job, `alignrl train ppo|grpo <verl
overrides>`: each makes its line a `Job` (a GroupLayout, the resolved config) that runs the one RL loop here.

Attaches to the cluster in RAY_ADDRESS (set inside `ray job submit`, or by hand: `RAY_ADDRESS=HOST:8100`),
else starts a local Ray with as many CPUs as the job asks for. Then: placement groups reserved (failing at once when
the cluster cannot hold them), reference workers, rollout engines and actor-group ranks started in their bundles,
`placement.json` written to the run folder (Ray's placement table of every group and the node of every worker), the
training loop run in every actor rank. A worker that dies ends the run within seconds with one line naming its role
and node; every worker and placement group is released on the way out.

A reward model (`--reward_pretrain`) runs in the reward group's workers (in the critic's placement group with
`--colocate_critic_reward`, in the actor's with `--colocate_all_models`); the engines send them the rows to score.
The critic (`--advantage_estimator gae`) trains in the critic group's workers (`alignrl.placements.ray.critic`):
the actor ranks send them their rows for values and updates.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field, replace

import ray
import torch
from ray.util.placement_group import placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from alignrl.placements.ray.channel import ClusterError, Peer, RayProducers, RayRefScorer, died_meanwhile
from alignrl.placements.ray.critic import CriticGroup, CriticRank
from alignrl.placements.ray.plan import GroupLayout, describe, engine_slot, release, requests, reserve, slots
from alignrl.placements.ray.workers import WATCH, EngineSpec, PolicyRank, RefWorker, RewardWorker, RolloutWorker
from alignrl.config import ConfigError, RunConfig, check_world_size, to_yaml
from alignrl.config.schema import REFERENCE_ANSWERS
from alignrl.errors import UserError
from alignrl.runtime.heap import settled
from alignrl.utils.atomic import atomic_write_text


@dataclass
class Job:
    """A placed run: where its workers go and the config every worker runs (resolved once, here)."""

    layout: GroupLayout
    cfg: RunConfig
    prog: str  # the command, for the driver's lines
    threads: int = 1  # torch CPU threads per Ray actor
    peer_timeout_s: float = 600.0  # torch.distributed's own default; generation waits without limit
    placement_timeout_s: float = 60.0
    weight_backend: str = "nccl"  # on GPUs; gloo without CUDA
    gpu_memory_utilization: float = 0.6  # of a vLLM engine's GPUs
    unused: list[str] = field(default_factory=list)  # settings accepted but not used here, listed once
    # set in each actor rank before its loop (a wandb key): passed with the call, never in the config text;
    # repr=False keeps it out of any printed Job
    rank_env: dict[str, str] = field(default_factory=dict, repr=False)


def check_inputs(cfg: RunConfig) -> None:
    """What the workers will load, checked here first: a bad data file or model folder is one line from the
    driver, not a worker's creation traceback wrapped in Ray's."""
    from alignrl.data.prompts import load_task_data
    from alignrl.models.loader import resolve_model_path
    from alignrl.placements.build import check_ref_folder
    from alignrl.preference.rm import check_rl_scorers
    from alignrl.rewards.registry import check_user_fns
    from alignrl.rollout.service_health import check_services
    from alignrl.train.checkpoint import check_newest_not_past

    if cfg.algorithm.adv_estimator in REFERENCE_ANSWERS:  # their rollout workers would find no reference there
        raise ConfigError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} samples with the reference model "
                          "where the rollouts are made, and a Ray run holds it in a group of its own: run it "
                          "in-process, on --nproc ranks or with ZeroMQ samplers")
    load_task_data(replace(cfg, data=replace(cfg.data, train_size=1)))  # generated rows need no check
    check_newest_not_past(cfg)  # before any worker starts, not after (tens of seconds on a cluster)
    for key, path in (("model.path", cfg.model.path), ("critic.model_path", cfg.critic.model_path)):
        if path and path != "demo":  # the demo model is built by the first worker that needs it
            resolve_model_path(path, key=key)
    check_ref_folder(cfg)  # the reference workers would load it: a wrong folder is one line from here
    check_rl_scorers(cfg, tokenizers=True)
    check_user_fns(cfg)
    check_services(cfg)  # before placement: an unreachable --remote_rm_url was found by the first rollout


def user_error(e: BaseException) -> Exception | None:
    """The user error (a bad row, a reward function that raised) inside Ray's wrapping of a worker's
    exception, which nests once per worker it crossed (an engine's, inside the actor rank's). The wrappers
    are instances of their cause's class too, with the whole remote traceback as their text: unwrapped."""
    while isinstance(e, ray.exceptions.RayTaskError):
        e = getattr(e, "cause", None)
    return e if isinstance(e, (ClusterError, UserError)) else None


def connect(units_needed: int) -> bool:
    """Joins RAY_ADDRESS, or the cluster `ray start` runs on this machine (as OpenRLHF's bare ray.init() does),
    or starts a local Ray; True when this process started it."""
    address = os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return False
    # a failed worker call is reported by the driver in one line; Ray would add its traceback for every failed
    # call whose result nobody fetched after that
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    if address:
        problem = address_problem(address)
        if problem:
            raise ClusterError(problem)
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=True)
        except (ValueError, ConnectionError) as e:
            raise ClusterError(f"RAY_ADDRESS={address}: {str(e).splitlines()[0]}") from None
        return False
    try:
        ray.init(num_cpus=max(units_needed, os.cpu_count() or 1), include_dashboard=False, logging_level="ERROR")
    except ValueError as e:  # Ray found a running cluster, which takes no resource counts: join it as it is
        if "existing cluster" not in str(e):
            raise
        ray.init(logging_level="ERROR", log_to_driver=True)
        return False
    return True


def address_problem(address: str, timeout_s: float = 5.0) -> str | None:
    """Why RAY_ADDRESS cannot be joined, in one line, or None: ray.init would otherwise wait on a dead address for
    minutes, printing only its GCS client's retries, and answers a dashboard URL with a traceback."""
    if address in ("auto", "local"):
        return None
    if address.startswith(("http://", "https://")):
        return (f"RAY_ADDRESS={address} is the dashboard's (job submission) address: give the cluster's GCS "
                "address, host:port (`ray start --head` prints it; 6379 by default), or submit the command with "
                "`ray job submit --address " + address + " -- ...`, which sets RAY_ADDRESS for it")
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not port.isdigit() or not host:
        return f"RAY_ADDRESS={address} is not host:port: give the cluster's GCS address (e.g. 10.0.0.1:6379)"
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        return (f"no Ray cluster answers at RAY_ADDRESS={address} ({e.strerror or e}): start one with "
                f"`ray start --head --port={port}` on {host}, or unset RAY_ADDRESS to start a local Ray")
    return None


def _stop_as_ctrl_c(signum, frame):
    """`kill` and `ray job stop` (SIGTERM) stop the run as Ctrl-C does: the workers released, one line. Ray's own
    handler, which ray.init installs in the driver, dumps a stack trace and aborts (exit 134). A second SIGTERM (a
    repeated kill) is ignored: it would cut the release of the workers short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


class Driver:
    def __init__(self, job: Job):
        self.job, self.cuda = job, torch.cuda.is_available()
        self.kind = "hf"  # the rollout engines' kind, chosen when they start
        self.reqs: dict = {}
        self.workers: list[Peer] = []  # everything started, for the watch and the clean-up
        self.loading: tuple = ()  # the reference group's pending loads, its workers, whether it is sharded

    def say(self, line: str) -> None:
        print(f"{self.job.prog}: {line}", flush=True)

    def start(self, cls, slot, name: str, *init, calls: int = 1, children_take_gpus: bool = False):
        """`children_take_gpus`: the worker holds none of its bundle's GPUs; the tasks it starts (vLLM's
        tensor-parallel workers) are placed in its placement group and take them."""
        # the CPU share too: an actor that names GPUs alone takes a whole CPU of its bundle (Ray's default),
        # and a bundle has one CPU per unit, so colocated workers would wait for CPUs forever
        gpus = 0.0 if children_take_gpus else slot.units
        res = {"num_gpus": gpus, "num_cpus": slot.units} if self.gpus else {"num_cpus": slot.units}
        env = {"OMP_NUM_THREADS": str(self.job.threads), "TOKENIZERS_PARALLELISM": "false",
               "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "RAY_IGNORE_UNHANDLED_ERRORS": "1"}
        if children_take_gpus:  # vLLM's Ray executor: one worker per listed one-GPU bundle of the group
            env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(i) for i in slot.group.order)
        handle = ray.remote(concurrency_groups=WATCH)(cls).options(
            **res, max_restarts=0, max_concurrency=calls, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=slot.group.pg, placement_group_bundle_index=slot.bundle,
                placement_group_capture_child_tasks=children_take_gpus),
            runtime_env={"env_vars": env}).remote(*init)
        peer = Peer(handle, name, slot.group.name, slot.bundle, slot.units)
        self.workers.append(peer)
        return peer

    def run(self) -> int:
        settled()  # the driver's start-up is over: it places and drives the workers (runtime.heap)
        job = self.job
        check_world_size(job.cfg, job.layout.world("actor"))
        check_inputs(job.cfg)
        self.reqs = requests(job.layout)
        started = connect(sum(r.nodes * r.per_node for r in self.reqs.values()))
        main = threading.current_thread() is threading.main_thread()  # signal handlers are set there only
        old = signal.signal(signal.SIGTERM, _stop_as_ctrl_c) if main else None
        try:
            self.gpus = ray.cluster_resources().get("GPU", 0.0) > 0
            self.say(f"placement: {describe(self.reqs, self.gpus)}")
            if job.unused:
                self.say(f"accepted but not used here: {'; '.join(job.unused)}")
            reserve(self.reqs, self.gpus, job.placement_timeout_s)
            return self.train()
        finally:
            self.shutdown(started)
            if main:  # None: Ray's handler, set from C, which cannot be put back
                signal.signal(signal.SIGTERM, signal.SIG_DFL if old is None else old)

    def train(self) -> int:
        job, lay = self.job, self.job.layout
        text, t = to_yaml(job.cfg), job.threads
        refs = self.start_refs(text) if "ref" in lay.groups else None
        rms = []
        if "reward" in lay.groups:
            rms = [self.start(RewardWorker, s, f"reward model rank {i}", text, s.local_rank, t)
                   for i, s in enumerate(slots(self.reqs, "reward", lay.world("reward"), lay.per_node("reward")))]
        engines = self.start_engines(text, refs, rms)
        actors = lay.world("actor")
        critics = self.start_critics(text, actors) if "critic" in lay.groups else None
        ranks = [self.start(PolicyRank, s, f"actor rank {r}", r, actors, s.local_rank, t, job.peer_timeout_s)
                 for r, s in enumerate(slots(self.reqs, "actor", actors, lay.per_node("actor")))]
        if refs is not None:  # before name_nodes: each worker's `where` waits for its load, under a time limit
            self.loaded_refs()
        self.name_nodes()
        master = ray.get(ranks[0].handle.free_address.remote())
        producers = RayProducers(engines, self.weight_backend(), job.peer_timeout_s, critics and CriticGroup(
            critics, ray.get(critics[0].handle.free_address.remote()), job.peer_timeout_s))
        t0 = time.time()
        runs = {r.handle.run.remote(text, master, producers, job.rank_env): r for r in ranks}
        summary = self.wait(runs)
        self.say(f"done in {time.time() - t0:.1f} s: {json.dumps(summary)}")
        return 0

    def engine_kind(self) -> str:
        """vLLM on GPUs when it is installed and the engines have GPUs of their own; the embedded HF
        engine otherwise (on CPUs, and for engines colocated with the actor ranks)."""
        if not self.cuda or self.job.layout.colocate_all_models:
            return "hf"
        if importlib.util.find_spec("vllm") is None:
            self.say("rollout engines: the embedded HF engine on each engine's first GPU (vllm is not installed)")
            return "hf"
        self.say(f"rollout engines: vLLM, tensor-parallel size {self.job.layout.tp}")
        return "vllm"

    def start_engines(self, text: str, refs: RayRefScorer | None, rms: list[Peer]) -> list[Peer]:
        """The rollout engines. A vLLM engine of tensor-parallel size T > 1 holds no GPU itself: vLLM's Ray
        executor puts its T workers on the T one-GPU bundles of the engine's group."""
        lay, job = self.job.layout, self.job
        self.kind = self.engine_kind()
        out = []
        for e in range(lay.engines):
            slot = engine_slot(self.reqs, e, lay.tp)
            spec = EngineSpec(self.kind, lay.tp, job.gpu_memory_utilization)
            out.append(self.start(RolloutWorker, slot, f"rollout engine {e}", text, e, slot.local_rank, job.threads,
                                  refs, rms, spec, children_take_gpus=self.kind == "vllm" and lay.tp > 1))
        return out

    def start_refs(self, text: str) -> RayRefScorer:
        """The reference group, loaded: one copy sharded over its ranks (`GroupLayout.shard_ref`, with more than one
        rank) or a whole copy in each."""
        lay, job = self.job.layout, self.job
        world = lay.world("ref")
        refs = [self.start(RefWorker, s, f"reference rank {i}", text, i, world, s.local_rank, job.threads,
                           job.peer_timeout_s)
                for i, s in enumerate(slots(self.reqs, "ref", world, lay.per_node("ref")))]
        sharded = lay.shard_ref and world > 1
        master = ray.get(refs[0].handle.free_address.remote()) if sharded else None
        # loaded while the other workers start (a worker serves its calls in order: no engine asks before)
        self.loading = [r.handle.build.remote(master) for r in refs], refs, sharded
        return RayRefScorer(refs, sharded)

    def loaded_refs(self) -> None:
        """Waits for the reference group to load (a big model takes minutes) while its workers live; the first
        failure ends the run in one line (the other ranks may be waiting for it in the rendezvous)."""
        builds, refs, sharded = self.loading
        of, held = dict(zip(builds, refs)), {}
        pending, waited = list(builds), 0.0
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=600.0)
            if not done:
                waited += 600.0
                self.say(f"{', '.join(of[r].name for r in pending)} still loading after {waited:g} s")
            for ref in done:
                held[ref] = self.result(ref, of[ref], {r: of[r] for r in pending})
        if sharded:
            self.say(f"reference: one copy sharded over {len(refs)} ranks ({held[builds[0]]:,} of "
                     f"{sum(held.values()):,} weights on rank 0)")

    def start_critics(self, text: str, actors: int) -> list[Peer]:
        """The critic group's ranks; each serves actors // C actor ranks, so it takes that many calls at
        once (their update rows are trained together)."""
        lay, job = self.job.layout, self.job
        world = lay.world("critic")
        return [self.start(CriticRank, s, f"critic rank {i}", text, i, world, s.local_rank, job.threads,
                           actors // world, job.peer_timeout_s, calls=actors // world)
                for i, s in enumerate(slots(self.reqs, "critic", world, lay.per_node("critic")))]

    def weight_backend(self) -> str:
        """NCCL on GPUs, except when the engines share GPUs with the actor ranks (`--colocate_all_models`,
        verl's hybrid layout): NCCL refuses two ranks of one group on one GPU, so the weights go over
        gloo through host memory there. Gloo without CUDA."""
        if not self.cuda or self.job.weight_backend != "nccl":
            return "gloo"
        if self.kind == "vllm" and self.job.layout.tp > 1:
            self.say("weights go to the engines over gloo: a tensor-parallel vLLM engine loads them through its "
                     "Ray executor's workers")
            return "gloo"
        if self.job.layout.colocate_all_models:
            self.say("weights go to the engines over gloo: they share GPUs with the actor ranks")
            return "gloo"
        return "nccl"

    def name_nodes(self) -> None:
        """Each worker's name gets its node (and the workers are up: their models are loaded); where
        everything runs goes to the run folder."""
        refs = [w.handle.where.remote() for w in self.workers]
        try:
            where = ray.get(refs, timeout=self.job.placement_timeout_s + 600)
        except ray.exceptions.GetTimeoutError:
            late = [w.name for w, r in zip(self.workers, refs) if not ray.wait([r], timeout=0)[0]]
            raise ClusterError(f"{', '.join(late[:3])} not up after {self.job.placement_timeout_s + 600:g} s "
                               "(the cluster cannot schedule it, or its model is still loading)") from None
        except ray.exceptions.RayActorError as e:
            dead = next((w.name for w in self.workers if w.handle._actor_id.hex() == getattr(e, "actor_id", None)),
                        "a worker")
            raise ClusterError(f"{dead} died while starting (killed, out of memory, or its model failed to "
                               "load: its log above says why); the run is stopped") from None
        for w, info in zip(self.workers, where):
            w.name = f"{w.name} on node {info['node']}"
            w.pid, w.node_id = info["pid"], info["node_id"]
        self.say("workers up: " + "; ".join(f"{w.name} (pid {w.pid})" for w in self.workers))
        self.write_placement()

    def write_placement(self) -> None:
        """`placement.json`: Ray's table of each placement group (bundles, their nodes, strategy) and,
        per worker, its group, bundle and node, so a finished run still says where it ran."""
        groups = {}
        for name, r in self.reqs.items():
            table = placement_group_table(r.pg)
            groups[name] = {"roles": r.roles, "strategy": table["strategy"], "bundles": table["bundles"],
                            "bundles_to_node_id": table["bundles_to_node_id"]}
        workers = [{"name": w.name.split(" on node ")[0], "node_id": w.node_id, "pid": w.pid,
                    "group": w.group, "bundle": w.bundle, "units": w.units}
                   for w in self.workers]
        run_dir = self.job.cfg.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / "placement.json", json.dumps({"groups": groups, "workers": workers}, indent=1))

    def wait(self, runs: dict) -> dict | None:
        """Until every actor rank returns; the first failure or death ends the run with one line."""
        watches = {w.handle.watch.remote(): w for w in self.workers if w not in runs.values()}
        pending, summary = list(runs) + list(watches), None
        while any(r in pending for r in runs):
            done, pending = ray.wait(pending, num_returns=1)
            ref = done[0]
            peer = runs.get(ref) or watches[ref]
            out = self.result(ref, peer, {r: runs.get(r) or watches[r] for r in pending})
            if ref in runs and out is not None:
                summary = out
        return summary

    def result(self, ref, peer: Peer, pending: dict):
        """ray.get of `peer`'s finished call `ref`; its failure as one line (`pending`: the calls still out, ref ->
        worker, to name a worker that died meanwhile as the cause)."""
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            cause, err = getattr(e, "cause", None), user_error(e)
            if isinstance(err, (ClusterError, ConfigError)):
                raise ClusterError(f"{peer.name}: {err}") from None
            if err is not None:  # bad data, a reward function that raised: the user's to fix (exit 2)
                raise err from None
            dead = died_meanwhile(pending)
            if dead is not None:
                raise ClusterError(f"{dead.name} died (killed, or out of memory); the run is stopped") from None
            first = (str(cause or e).strip().splitlines() or ["?"])[-1]
            raise ClusterError(f"{peer.name} failed: {first} ({self.keep_traceback(peer, str(e))})") from None
        except ray.exceptions.RayActorError:
            raise ClusterError(f"{peer.name} died (killed, or out of memory); the run is stopped") from None

    def keep_traceback(self, peer: Peer, text: str) -> str:
        """Where the worker's traceback (inside Ray's error) is kept: a file of the run's logs, as `ray job submit`
        shows the driver's output only."""
        path = self.job.cfg.log_root / f"error-{peer.name.replace(' ', '_')}.txt"
        try:
            atomic_write_text(path, text + "\n")
        except OSError:
            return "its traceback is in Ray's worker logs"
        return f"its traceback: {path}"

    def shutdown(self, started: bool) -> None:
        for w in self.workers:
            ray.kill(w.handle, no_restart=True)
        release(self.reqs)
        if started:
            ray.shutdown()
