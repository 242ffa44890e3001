"""The critic group of the Ray placement (`--critic_num_nodes × --critic_num_gpus_per_node`): PPO's value
model (and, with a safety cost, the cost critic) trained in Ray actors of its own, with torch.distributed
among them, while the actor group trains the policy.

    actor rank r: RayCritic.values(rows)  --> critic rank r % C: values of rank r's rows
                  RayCritic.update(rows)  --> critic rank r % C: once the rows of all its actor ranks
                                              (r % C, r % C + C, ...) are in, one update on them all

As in OpenRLHF, the actor world is a multiple of the critic world and actor rank r talks to critic rank
r % C. Each critic rank trains on the rows of its actor ranks with their mini-batch shares added up, so
the global mini-batch is the one the trainer asks for, whatever C is. The multiplier of PPO-Lagrangian
stays with the trainer (it is part of its state); the critics' weights and optimizer state go into the
run's checkpoint folders (`critic/`, `critic_state/`), written by the critic ranks themselves: on several
nodes the checkpoint path must be on a filesystem they share, as OpenRLHF's `--ckpt_path` must be.
"""

from __future__ import annotations

import threading
from pathlib import Path

import ray
import torch

from alignrl.placements.ray.channel import ClusterError, Peer, get
from alignrl.placements.ray.workers import Worker, config_of, join_group
from alignrl.data.records import Experience, Rollout


def cat_experiences(parts: list[Experience]) -> Experience:
    """The rows of several actor ranks' shares of one global batch (equal widths), in rank order."""
    if len(parts) == 1:
        return parts[0]
    fields = [f for f in Experience.__dataclass_fields__]
    return Experience(*(None if getattr(parts[0], f) is None else torch.cat([getattr(p, f) for p in parts])
                        for f in fields))


class CriticRank(Worker):
    """Rank `rank` of the critic group. `build` (called by actor rank 0 on every critic rank at once)
    joins the group's torch.distributed and loads the critics; `values` and `update` serve the actor ranks
    that map to this rank (several at a time: the actor is made with that many threads)."""

    def __init__(self, cfg_text: str, rank: int, world: int, local_rank: int, threads: int, parts: int,
                 peer_timeout_s: float):
        super().__init__(threads)
        self.cfg, self.rank, self.world, self.local_rank = config_of(cfg_text), rank, world, local_rank
        self.parts, self.timeout_s = parts, peer_timeout_s  # actor ranks served: their updates are trained together
        self.critics: dict = {}
        self.compute = threading.Lock()  # one forward or update at a time, in call order
        self.arrived = threading.Condition()
        self.pending: dict[tuple[str, int], dict[int, tuple]] = {}  # (critic, round) -> parts in so far
        self.results: dict[tuple[str, int], list] = {}  # (critic, round) -> [metrics or exception, readers left]

    def build(self, master: tuple[str, int], resume: str | None) -> None:
        from alignrl.placements.build import build_critic, critic_names
        from alignrl.runtime.env import init_distributed

        join_group(self.rank, self.world, self.local_rank, master, self.timeout_s)
        env = init_distributed(self.cfg.trainer.device)
        self.env = env
        folder = Path(resume) if resume else None
        self.critics = {name: build_critic(self.cfg, name, folder, env) for name in critic_names(self.cfg)}

    def values(self, name: str, ro: Rollout, micro: int) -> torch.Tensor:
        with self.compute, torch.no_grad():
            return self.critics[name].values(ro, micro).cpu()

    def update(self, name: str, round_: int, part: int, exp: Experience, old_values: torch.Tensor,
               returns: torch.Tensor, mini: int, micro: int, epochs: int, seed: int) -> dict[str, float]:
        """Part `part` of this round's rows; the call that brings the last part trains on all of them,
        and every part's call returns the same metrics (or raises the same error). Rounds are counted per
        critic, so the reward and cost critics are at the same round at once: both name the entries."""
        key = (name, round_)
        with self.arrived:
            got = self.pending.setdefault(key, {})
            got[part] = (exp, old_values, returns)
            if len(got) == self.parts:
                rows = [got[i] for i in range(self.parts)]
                del self.pending[key]
                try:
                    with self.compute:
                        out = self.critics[name].update(
                            cat_experiences([r[0] for r in rows]), torch.cat([r[1] for r in rows]),
                            torch.cat([r[2] for r in rows]), mini * self.parts, micro, epochs,
                            torch.Generator().manual_seed(seed))
                except Exception as e:  # every waiting part gets it
                    out = e
                self.results[key] = [out, self.parts]
                self.arrived.notify_all()
            elif not self.arrived.wait_for(lambda: key in self.results, timeout=self.timeout_s):
                raise ClusterError(f"critic rank {self.rank}: the other actor ranks' rows of this update did not "
                                   f"come in {self.timeout_s:g} s")
            res = self.results[key]
            res[1] -= 1
            if res[1] == 0:
                del self.results[key]
        if isinstance(res[0], Exception):
            raise res[0]
        return res[0]

    def save(self, folder: str, name: str) -> str | None:
        """Writes `folder/name` and `folder/name_state` (collective over the critic group); None, or the
        line saying why not."""
        from alignrl.train.checkpoint import NonFiniteWeights, save_engine

        try:
            with self.compute:
                save_engine(self.critics[name].engine, Path(folder), name, self.env)
        except NonFiniteWeights as e:
            return str(e)
        return None


class RayCritic:
    """What the trainer of actor rank r holds for critic `name`: its values and updates go to critic rank
    r % C; the checkpoint writes go to the whole group."""

    def __init__(self, name: str, group: list[Peer], rank: int, timeout_s: float):
        self.name, self.group, self.timeout_s = name, group, timeout_s
        self.peer = group[rank % len(group)]
        self.part = rank // len(group)  # this rank's place among those the critic rank serves
        self.rounds = 0  # updates asked so far: every actor rank asks for the same ones

    def values(self, ro: Rollout, micro: int) -> torch.Tensor:
        return get([self.peer.handle.values.remote(self.name, ro, micro)], [self.peer], self.timeout_s)[0]

    def update(self, exp: Experience, old_values: torch.Tensor, returns: torch.Tensor, mini_batch: int,
               micro_batch: int, epochs: int, generator: torch.Generator) -> dict[str, float]:
        self.rounds += 1
        ref = self.peer.handle.update.remote(self.name, self.rounds, self.part, exp, old_values, returns, mini_batch,
                                             micro_batch, epochs, generator.initial_seed())
        return remote_result(ref, self.peer, self.timeout_s)

    def save(self, folder: Path) -> str | None:
        refs = [p.handle.save.remote(str(folder), self.name) for p in self.group]
        lines = [remote_result(r, p, self.timeout_s) for r, p in zip(refs, self.group)]
        return next((line for line in lines if line), None)


def remote_result(ref, peer: Peer, timeout_s: float):
    """One call's result; the error a critic rank raised comes back as one line naming it."""
    try:
        return get([ref], [peer], timeout_s)[0]
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None) or e
        last = (str(cause).strip().splitlines() or ["?"])[-1]
        raise ClusterError(f"{peer.name}: {last}") from None


class CriticGroup:
    """The critic group's workers as the Ray producers hand them to every actor rank (handles only)."""

    def __init__(self, workers: list[Peer], master: tuple[str, int], timeout_s: float):
        self.workers, self.master, self.timeout_s = workers, master, timeout_s

    def critics(self, cfg, resume: Path | None, env):
        """Actor rank 0 builds the critic ranks (from the checkpoint when resuming); every actor rank gets
        a RayCritic for each critic the run trains."""
        from alignrl.placements.build import build_critics
        from alignrl.runtime.env import barrier

        if env.is_main:
            refs = [w.handle.build.remote(self.master, str(resume) if resume else None) for w in self.workers]
            for r, w in zip(refs, self.workers):
                remote_result(r, w, self.timeout_s)
        barrier(env)  # no rank asks for values before the critics are up
        return build_critics(cfg, resume, env,
                             make=lambda name: RayCritic(name, self.workers, env.rank, self.timeout_s))
