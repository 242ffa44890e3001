"""Placement groups from a GroupLayout (OpenRLHF's flags, or verl's hybrid engine from trainer.nnodes ×
trainer.n_gpus_per_node): which worker group goes where, reserved before any model loads.

A group of N nodes × G GPUs is one placement group of N·G one-unit bundles, G on each of N distinct nodes,
so "2 nodes × 4 GPUs" is what the cluster gives. Every worker is pinned to one bundle, hence to one GPU:
rank r of a group takes the r-th bundle in node order, so consecutive ranks share a node. Colocated roles
share a placement group and split each unit between them (actor and reference with `--colocate_actor_ref`,
critic and reward with `--colocate_critic_reward`, everything including the rollout engines with
`--colocate_all_models`): rank r of each takes the same bundle. (Bundles of a whole node's G units let
Ray choose the GPU of each fractional worker, and its best fit put four reference ranks on one GPU, leaving
no room for the fourth actor rank: the run waited for ever.) A rollout engine of tensor-parallel size T is
its own group of T bundles on one node unless colocated (vLLM's Ray executor starts one worker per one-GPU
bundle of the group it runs in).

Ray cannot ask for "G bundles on each of N distinct nodes" in one request, so a group over several nodes
is reserved in two moves: a STRICT_SPREAD group of N node-sized bundles lets Ray choose the nodes, then it
is replaced by the one-unit bundles, each pinned to its node by the node-id label.

On a cluster without GPUs a unit is a CPU: the flags' GPU counts become process counts.
Before waiting, the demand is compared with the cluster's free resources, so an impossible request
fails at once with one line; a possible-looking one that is not granted in `timeout_s` fails too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from alignrl.errors import ConfigError
from alignrl.placements.ray.roles import uses_critic, uses_reference, uses_reward_model


class PlacementError(ConfigError):
    """What was asked cannot be placed on this cluster; one line with the request and the cluster."""


@dataclass
class GroupRequest:
    """One placement group: `nodes` × `per_node` one-unit bundles, and the roles that share it."""

    name: str
    nodes: int
    per_node: int
    roles: list[str] = field(default_factory=list)
    pg: object = None
    order: list[int] = field(default_factory=list)  # bundle indices sorted by node
    node_of: dict[int, str] = field(default_factory=dict)  # bundle index -> node id

    def share(self, role: str) -> float:
        """The fraction of its unit a worker of `role` takes: as in OpenRLHF, the group's first role 0.75,
        and the roles sharing the group split the rest."""
        if len(self.roles) == 1:
            return 1.0
        return 0.75 if role == self.roles[0] else round(0.25 / (len(self.roles) - 1), 4)


@dataclass
class Slot:
    """Where one worker of a role runs: its placement group, bundle, rank inside the node and share."""

    group: GroupRequest
    bundle: int
    local_rank: int
    units: float

    @property
    def node(self) -> str:
        return self.group.node_of[self.bundle]


@dataclass
class GroupLayout:
    """What either command line asks to place: nodes × units of each worker group that runs (actor, and
    ref / critic / reward when they have Ray workers of their own), the rollout engines, the colocation."""

    groups: dict[str, tuple[int, int]]  # role -> (nodes, units per node)
    engines: int
    tp: int
    colocate_actor_ref: bool = False
    colocate_critic_reward: bool = False
    colocate_all_models: bool = False
    shard_ref: bool = False  # one reference model sharded over the reference group (ZeRO-3, verl's FSDP)

    def world(self, role: str) -> int:
        nodes, per_node = self.groups[role]
        return nodes * per_node

    def per_node(self, role: str) -> int:
        return self.groups[role][1]

    @classmethod
    def from_flags(cls, args) -> GroupLayout:
        """OpenRLHF's flags: the groups their estimator, KL and reward flags make run."""
        roles = ["actor"] + [r for r, used in (("ref", uses_reference(args)), ("critic", uses_critic(args)),
                                               ("reward", uses_reward_model(args))) if used]
        return cls({r: (getattr(args, f"{r}_num_nodes"), getattr(args, f"{r}_num_gpus_per_node")) for r in roles},
                   args.vllm_num_engines, args.vllm_tensor_parallel_size, args.colocate_actor_ref,
                   args.colocate_critic_reward, args.colocate_all_models, shard_ref=args.zero_stage == 3)

    @classmethod
    def hybrid(cls, nodes: int, per_node: int, reference: bool) -> GroupLayout:
        """verl's hybrid engine (`trainer.nnodes` × `trainer.n_gpus_per_node`): every unit holds one actor
        rank, one rollout engine of tensor-parallel size 1 and, with a KL term, one reference worker (the
        reference workers hold one copy sharded among them, as verl's FSDP reference does)."""
        groups = {"actor": (nodes, per_node), **({"ref": (nodes, per_node)} if reference else {})}
        return cls(groups, nodes * per_node, 1, colocate_actor_ref=True, colocate_all_models=True, shard_ref=True)


def requests(layout) -> dict[str, GroupRequest]:
    """Placement groups by name, each with the roles that share it (`layout`: a GroupLayout, or the flags)."""
    if not isinstance(layout, GroupLayout):
        layout = GroupLayout.from_flags(layout)
    lay, out = layout, {}

    def add(role: str, home: str | None = None) -> None:
        if role not in lay.groups:
            return
        if home is not None and home in out:
            out[home].roles.append(role)
            return
        out[role] = GroupRequest(role, *lay.groups[role], [role])

    add("actor")
    add("ref", "actor" if lay.colocate_actor_ref or lay.colocate_all_models else None)
    add("critic", "actor" if lay.colocate_all_models else None)
    add("reward", "actor" if lay.colocate_all_models else "critic" if lay.colocate_critic_reward else None)
    for e in range(lay.engines):
        if lay.colocate_all_models:
            out["actor"].roles.append(f"engine{e}")
        else:
            out[f"engine{e}"] = GroupRequest(f"engine{e}", 1, lay.tp, [f"engine{e}"])
    return out


def unit(gpus: bool) -> str:
    return "GPU" if gpus else "CPU"


def describe(reqs: dict[str, GroupRequest], gpus: bool) -> str:
    parts = []
    for r in reqs.values():
        shared = f" (with {', '.join(r.roles[1:])})" if len(r.roles) > 1 else ""
        parts.append(f"{r.name} {r.nodes} node(s) × {r.per_node} {unit(gpus)}{shared}")
    total = sum(r.nodes * r.per_node for r in reqs.values())
    return f"{'; '.join(parts)} = {total} {unit(gpus)}"


def cluster_view(gpus: bool) -> tuple[list[float], str]:
    """Free units per alive node, and a line describing the cluster."""
    res = unit(gpus)
    free = ray.available_resources()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    totals = [float(n["Resources"].get(res, 0.0)) for n in nodes]
    line = (f"the cluster has {len(nodes)} node(s) with {', '.join(f'{t:g}' for t in totals)} {res} "
            f"({free.get(res, 0.0):g} free)")
    return totals, line


def precheck(reqs: dict[str, GroupRequest], gpus: bool) -> None:
    """Requests no packing can satisfy, refused at once."""
    totals, line = cluster_view(gpus)
    free = ray.available_resources().get(unit(gpus), 0.0)
    need = sum(r.nodes * r.per_node for r in reqs.values())
    for r in reqs.values():
        fits = [t for t in totals if t >= r.per_node]
        if len(fits) < r.nodes:
            raise PlacementError(f"placement asked for {describe(reqs, gpus)}, but {r.name} needs {r.nodes} node(s) "
                                 f"with {r.per_node} {unit(gpus)} each; {line}")
    deadline = time.monotonic() + 2.0
    while need > free and time.monotonic() < deadline:  # Ray's view lags groups removed a moment ago
        time.sleep(0.1)
        free = ray.available_resources().get(unit(gpus), 0.0)
    if need > free:
        raise PlacementError(f"placement asked for {describe(reqs, gpus)}; {line}")


def reserve(reqs: dict[str, GroupRequest], gpus: bool, timeout_s: float) -> None:
    """Creates every placement group and waits (at most `timeout_s` in all) until each is granted."""
    precheck(reqs, gpus)
    res = unit(gpus)
    deadline = time.monotonic() + timeout_s
    spread = [r for r in reqs.values() if r.nodes > 1]
    for r in reqs.values():  # groups over several nodes: node-sized bundles first, to choose the nodes
        if r.nodes > 1:
            r.pg = placement_group(_bundles(res, r.per_node, r.nodes), "STRICT_SPREAD", name=f"alignrl-{r.name}")
        else:
            r.pg = placement_group(_bundles(res, 1, r.per_node), "STRICT_PACK", name=f"alignrl-{r.name}")
    for r in reqs.values():
        _granted(reqs, r, gpus, deadline, timeout_s)
    for r in spread:  # then one-unit bundles on the nodes Ray chose, in place of the node-sized ones
        nodes = list(placement_group_table(r.pg)["bundles_to_node_id"].values())
        remove_placement_group(r.pg)
        r.pg = placement_group(_bundles(res, 1, r.nodes * r.per_node), "PACK", name=f"alignrl-{r.name}",
                               bundle_label_selector=[{NODE_LABEL: n} for n in nodes for _ in range(r.per_node)])
    for r in spread:
        _granted(reqs, r, gpus, deadline, timeout_s)
    for r in reqs.values():
        r.node_of = {int(k): v for k, v in placement_group_table(r.pg)["bundles_to_node_id"].items()}
        r.order = sorted(r.node_of, key=lambda i: (r.node_of[i], i))  # same-node bundles together, in order


NODE_LABEL = "ray.io/node-id"  # every Ray node carries it


def _bundles(res: str, units: int, count: int) -> list[dict]:
    """`count` bundles of `units` of the placement's unit each, with one CPU per unit on GPU nodes (a
    worker process needs a CPU too)."""
    return [{res: float(units)} if res == "CPU" else {res: float(units), "CPU": float(units)} for _ in range(count)]


def _granted(reqs: dict[str, GroupRequest], r: GroupRequest, gpus: bool, deadline: float, timeout_s: float) -> None:
    """Waits until `r`'s group is granted; releases every group and says why when the deadline passes."""
    ready, _ = ray.wait([r.pg.ready()], timeout=max(0.1, deadline - time.monotonic()))
    if not ready:
        _, line = cluster_view(gpus)
        release(reqs)
        raise PlacementError(f"placement group {r.name} ({r.nodes} node(s) × {r.per_node} {unit(gpus)}) was not "
                             f"granted in {timeout_s:g} s; asked for {describe(reqs, gpus)}; {line}")


def release(reqs: dict[str, GroupRequest], wait_s: float = 10.0) -> None:
    """Removes the placement groups and waits (briefly) until Ray has taken them back."""
    pgs = [r.pg for r in reqs.values() if r.pg is not None]
    for r in reqs.values():
        r.pg = None
    for pg in pgs:
        remove_placement_group(pg)
    deadline = time.monotonic() + wait_s
    while pgs and time.monotonic() < deadline:
        pgs = [pg for pg in pgs if placement_group_table(pg).get("state") != "REMOVED"]
        time.sleep(0.05)


def slots(reqs: dict[str, GroupRequest], role: str, count: int, per_node: int) -> list[Slot]:
    """`count` workers of `role` in the group that holds it: rank r in bundle order[r]."""
    group = next(r for r in reqs.values() if role in r.roles)
    return [Slot(group, group.order[r], r % per_node, group.share(role)) for r in range(count)]


def engine_slot(reqs: dict[str, GroupRequest], e: int, tp: int) -> Slot:
    """Engine e's slot: the first of its own group's T bundles (vLLM's tensor-parallel workers take all
    T), or (all colocated) the first of its T units in the actor's group."""
    group = next(r for r in reqs.values() if f"engine{e}" in r.roles)
    if group.name == f"engine{e}":
        return Slot(group, group.order[0], 0, 1.0)
    first = e * tp
    return Slot(group, group.order[first], first % group.per_node, group.share(f"engine{e}"))
