"""`alignrl train ppo-ray` (OpenRLHF's `train_ppo_ray` flags): places the worker groups on a Ray
cluster and runs the one RL loop on them.

Attaches to the cluster in RAY_ADDRESS (set inside `ray job submit`, or by hand: `RAY_ADDRESS=HOST:8100`),
else starts a local Ray with as many CPUs as the flags ask for. Then: the flags' checks, placement
groups reserved (failing at once when the cluster cannot hold them), reference workers, rollout engines
and actor-group ranks started in their bundles, the training loop run in every actor rank. A worker
that dies ends the run within seconds with one line naming its role and node; every worker and
placement group is released on the way out.

Critic and reward-model groups are reserved as the flags say, but the critic trains inside the actor
ranks and the reward model scores inside the rollout engines (the loop's own placement of them).
"""

from __future__ import annotations

import json
import os
import sys
import time

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from alignrl.cluster import flags as F
from alignrl.cluster.channel import ClusterError, Peer, RayProducers
from alignrl.cluster.plan import describe, engine_slot, release, requests, reserve, slots
from alignrl.cluster.workers import WATCH, PolicyRank, RefWorker, RolloutWorker
from alignrl.config import ConfigError, check_world_size, load_config

PROG = F.PROG


def connect(units_needed: int) -> bool:
    """Joins RAY_ADDRESS or starts a local Ray; True when this process started it."""
    address = os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, logging_level="ERROR", log_to_driver=True)
        return False
    ray.init(num_cpus=max(units_needed, os.cpu_count() or 1), include_dashboard=False, logging_level="ERROR")
    return True


def training_steps(args) -> int:
    """OpenRLHF's count: episodes × full rollout batches in the (capped) prompt data."""
    if args.total_steps:
        return args.total_steps
    if args.prompt_data == "synthetic":
        rows = args.max_samples
    else:
        from alignrl.data.loaders import load_samples

        rows = min(args.max_samples, len(load_samples(args.prompt_data, "auto", key="--prompt_data")))
    steps = args.num_episodes * (rows // args.rollout_batch_size)
    if steps < 1:
        raise ConfigError(f"--prompt_data has {rows} prompt(s), fewer than --rollout_batch_size "
                          f"{args.rollout_batch_size}: lower it or give more data")
    return steps


class Driver:
    def __init__(self, args):
        self.args, self.cuda = args, torch.cuda.is_available()
        self.reqs: dict = {}
        self.workers: list[Peer] = []  # everything started, for the watch and the clean-up

    def start(self, cls, slot, name: str, *init):
        a = self.args
        res = {"num_gpus": slot.units} if self.gpus else {"num_cpus": slot.units}
        handle = ray.remote(concurrency_groups=WATCH)(cls).options(
            **res, max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=slot.group.pg, placement_group_bundle_index=slot.bundle),
            runtime_env={"env_vars": {"OMP_NUM_THREADS": str(a.threads), "TOKENIZERS_PARALLELISM": "false",
                                      "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}).remote(*init)
        peer = Peer(handle, name)
        self.workers.append(peer)
        return peer

    def run(self) -> int:
        a = self.args
        steps = training_steps(a)
        overrides = F.overrides(a, self.cuda, steps)
        cfg = load_config(None, overrides)
        actors = F.world(a, "actor")
        check_world_size(cfg, actors)
        self.reqs = requests(a)
        started = connect(sum(r.nodes * r.per_node for r in self.reqs.values()))
        try:
            self.gpus = ray.cluster_resources().get("GPU", 0.0) > 0
            print(f"{PROG}: placement: {describe(self.reqs, self.gpus)}", flush=True)
            unused = F.unused_here(a, self.cuda)
            if unused:
                print(f"{PROG}: accepted but not used here{'' if self.cuda else ' (no CUDA)'}: {' '.join(unused)}",
                      flush=True)
            reserve(self.reqs, self.gpus, a.placement_timeout)
            return self.train(overrides, actors)
        finally:
            self.shutdown(started)

    def train(self, overrides: list[str], actors: int) -> int:
        a = self.args
        refs = []
        if F.uses_reference(a):
            refs = [self.start(RefWorker, s, f"reference rank {i}", overrides, s.local_rank, a.threads)
                    for i, s in enumerate(slots(self.reqs, "ref", F.world(a, "ref"), a.ref_num_gpus_per_node))]
        engines = [self.start(RolloutWorker, s, f"rollout engine {e}", overrides, e, s.local_rank, a.threads, refs)
                   for e, s in ((e, engine_slot(self.reqs, e, a.vllm_tensor_parallel_size))
                                for e in range(a.vllm_num_engines))]
        ranks = [self.start(PolicyRank, s, f"actor rank {r}", r, actors, s.local_rank, a.threads, a.peer_timeout)
                 for r, s in enumerate(slots(self.reqs, "actor", actors, a.actor_num_gpus_per_node))]
        self.name_nodes()
        master = ray.get(ranks[0].handle.free_address.remote())
        backend = a.vllm_sync_backend if self.cuda else "gloo"
        producers = RayProducers(engines, backend, a.peer_timeout)
        t0 = time.time()
        runs = {r.handle.run.remote(overrides, master, producers): r for r in ranks}
        summary = self.wait(runs)
        print(f"{PROG}: done in {time.time() - t0:.1f} s: {json.dumps(summary)}", flush=True)
        return 0

    def name_nodes(self) -> None:
        """Each worker's name gets its node (and the workers are up: their models are loaded)."""
        where = ray.get([w.handle.where.remote() for w in self.workers], timeout=self.args.placement_timeout + 600)
        for w, info in zip(self.workers, where):
            w.name = f"{w.name} on node {info['node']}"
            w.pid = info["pid"]
        print(f"{PROG}: workers up: " + "; ".join(f"{w.name} (pid {w.pid})" for w in self.workers), flush=True)

    def wait(self, runs: dict) -> dict | None:
        """Until every actor rank returns; the first failure or death ends the run with one line."""
        watches = {w.handle.watch.remote(): w for w in self.workers if w not in runs.values()}
        pending, summary = list(runs) + list(watches), None
        while any(r in pending for r in runs):
            done, pending = ray.wait(pending, num_returns=1)
            ref = done[0]
            peer = runs.get(ref) or watches[ref]
            try:
                out = ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                cause = getattr(e, "cause", None)
                if isinstance(cause, (ClusterError, ConfigError)):
                    raise ClusterError(f"{peer.name}: {cause}") from None
                first = (str(cause or e).strip().splitlines() or ["?"])[-1]
                raise ClusterError(f"{peer.name} failed: {first} (its traceback is in the worker log above)") from None
            except ray.exceptions.RayActorError:
                raise ClusterError(f"{peer.name} died (killed, or out of memory); the run is stopped") from None
            if ref in runs and out is not None:
                summary = out
        return summary

    def shutdown(self, started: bool) -> None:
        for w in self.workers:
            ray.kill(w.handle, no_restart=True)
        release(self.reqs)
        if started:
            ray.shutdown()


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    from alignrl.cli import _user_errors

    args = F.parser(prog).parse_args(argv)
    try:
        F.check(args)
        return Driver(args).run()
    except (ClusterError, *_user_errors()) as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 1 if isinstance(e, ClusterError) else 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python -m alignrl.cluster.train_ppo_ray"))
