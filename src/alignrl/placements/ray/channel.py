"""The Ray channel of the loop: the BatchSource and WeightSink an actor-group rank runs with, and the
RefScorer and reward-model scorer a rollout engine uses when the reference or the reward model is a
group of Ray actors of its own.

    actor rank r: RaySource.next_batch(step) --batch(step, share e)--> rollout engine e (each share once)
                  <-- ScoredBatch (Ray's object store) ; all shares merged ; rank r keeps its prompt groups
    actor rank 0: RayWeightSink.publish(v) --receive--> engines ; bucketed broadcast v ; engines ack v

Every rank asks every engine for the same step's share; an engine makes it once and hands the same
record to all. With one engine the global batch is the one the in-process loop makes (same rows, same
sampling seeds), so the Ray placement trains exactly as one process does, up to the all-reduce.
With dynamic sampling every engine filters its share and the ranks refill the merged batch together: they hold
the same merged batch and the same sampler, so they draw the same extra rounds without a collective, and each
rank trains an equal share of the groups kept (shard_groups). Deliberately left out: asynchronous (off-policy)
generation.
"""

from __future__ import annotations

import time
from dataclasses import replace

import ray
import torch

from alignrl.placements.weight_sync import Outgoing
from alignrl.placements.build import build_critics
from alignrl.rl.producer import InlineSource, merged_metrics
from alignrl.rl.rollout_ops import concat_rollouts, groups_in, keep_first_groups, pad_cols, shard_groups
from alignrl.data.images import ImageRows
from alignrl.data.records import Rollout, ScoredBatch
from alignrl.data.sampler import BatchSampler
from alignrl.runtime.env import DistEnv, barrier
from alignrl.runtime.ports import free_port
from alignrl.interfaces import SamplingParams
from alignrl.train.actor import Actor
from alignrl.wire.records import images_to_wire

BUCKET_BYTES = 32 << 20


class ClusterError(RuntimeError):
    """A worker of the Ray placement died or failed; one line naming its role and node."""


class Peer:
    """A Ray actor handle with the name error lines give it ("rollout engine 0 on node 10.0.0.5 (ab12cd34)")."""

    def __init__(self, handle, name: str, group: str = "", bundle: int = 0, units: float = 0.0):
        self.handle, self.name = handle, name
        self.group, self.bundle, self.units = group, bundle, units  # where the driver placed it
        self.pid, self.node_id = 0, ""  # filled in once it is up


def get(refs: list, peers: list[Peer], timeout_s: float) -> list:
    """ray.get of one call per peer; a dead peer or a timeout becomes one ClusterError line."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ClusterError(f"no answer in {timeout_s:g} s from {', '.join(p.name for p in peers)}") from None
    except ray.exceptions.RayActorError:
        dead = [p.name for p, r in zip(peers, refs) if _died(r)]
        raise ClusterError(f"{' and '.join(dead) or 'a worker'} died (killed or out of memory)") from None


def patient_get(refs: list, peers: list[Peer], every_s: float = 600.0, say=lambda line: None) -> list:
    """ray.get of calls that take as long as their work does (a step's generation, which on a big model and
    batch runs for many minutes): no time limit while the peers live, one `say` line every `every_s`
    seconds naming those still at it. Ray fails the call of a peer that dies, and `get` makes that one line."""
    waited = 0.0
    while True:
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=every_s)
        if not pending:
            return get(refs, peers, every_s)
        waited += every_s
        busy = ", ".join(p.name for p, r in zip(peers, refs) if r in pending)
        say(f"{busy} still at work after {waited:g} s")


def _died(ref) -> bool:
    try:
        ray.get(ref, timeout=0)
        return False
    except ray.exceptions.RayActorError:
        return True
    except Exception:
        return False


def merge(batches: list[ScoredBatch], pad_id: int, drawn: list[int]) -> ScoredBatch:
    """The engines' shares as one global batch, in share order (groups renumbered, widths padded); `drawn`: the
    sequences each share's metrics describe."""
    out = batches[0]
    for b in batches[1:]:
        ro = concat_rollouts(out.rollout, b.rollout, pad_id)
        width = ro.response_ids.shape[1]

        def cat(x: torch.Tensor, y: torch.Tensor, value) -> torch.Tensor:  # response columns, right-padded
            return torch.cat([pad_cols(t, width, value, left=False) for t in (x, y)])

        ref = None if out.ref_logprobs is None else cat(out.ref_logprobs, b.ref_logprobs, 0.0)
        out = ScoredBatch(ro, out.scores.cat(b.scores), cat(out.loss_mask, b.loss_mask, False), ref,
                          torch.cat([out.prompt_index, b.prompt_index]), min(out.version, b.version),
                          "ray", out.metrics)
    if len(batches) > 1:
        out.metrics = merged_metrics(list(zip((b.metrics for b in batches), drawn)))
    return out


def split_call(workers: list[Peer], method: str, tensors: tuple[torch.Tensor, ...], every: bool = False,
               images: ImageRows | None = None) -> torch.Tensor:
    """`method` of each worker on its even share of the rows of `tensors` (one call per worker that has
    rows, or per worker with `every`: a collective call), the results concatenated in row order. Waited for as
    long as the workers live: a worker serves one call at a time, so a large batch's calls queue behind other
    engines' (a fixed limit cut off big steps). `images` (the rows' prompt images) go with their rows as the wire's
    flat tensors (`wire.records.images_to_wire`), keyword `images`, as the rows' own tensors travel."""
    parts = [t.tensor_split(len(workers)) for t in tensors]
    ends = torch.tensor([len(p) for p in parts[0]]).cumsum(0).tolist()
    calls = []
    for w, args, end in zip(workers, zip(*parts), ends):
        if not (every or len(args[0])):
            continue
        extra = {} if images is None else {"images": images_to_wire(images.select(range(end - len(args[0]), end)))}
        calls.append((w, getattr(w.handle, method).remote(*args, **extra)))
    return torch.cat(patient_get([r for _, r in calls], [w for w, _ in calls]))


class RayRefScorer:
    """RefScorer over the reference group's Ray actors: rows split evenly, one call per worker (every worker,
    with an empty share too, when they hold one sharded model: their forwards are collective)."""

    def __init__(self, workers: list[Peer], sharded: bool = False):
        self.workers, self.sharded = workers, sharded

    def logprobs(self, prompt_ids, prompt_mask, response_ids, response_mask, images: ImageRows | None = None
                 ) -> torch.Tensor:
        return split_call(self.workers, "logprobs", (prompt_ids, prompt_mask, response_ids, response_mask),
                          every=self.sharded, images=images)


class RayRewardScorer:
    """The reward model as the reward stage's SequenceScorer, over the reward group's Ray actors: rows split
    evenly, one call per worker, scores (B,) in row order."""

    def __init__(self, workers: list[Peer], name: str):
        self.workers, self.name = workers, name

    def score(self, prompt_ids, prompt_mask, response_ids, response_mask) -> torch.Tensor:
        return split_call(self.workers, "score", (prompt_ids, prompt_mask, response_ids, response_mask))


class RayEvalEngine:
    """The held-out evaluation's RolloutEngine: the rollout engines, which hold the actor's weights after every
    publish (OpenRLHF and verl evaluate on their vLLM engines too). The prompts are split evenly over them, one call
    each, the rollouts joined in prompt order. The actor ranks keep no full copy for it: a sharded policy's
    (ZeRO-3, FSDP) would be a whole model on rank 0's GPU beside its shard."""

    def __init__(self, engines: list[Peer], pad_id: int):
        self.engines, self.pad_id = engines, pad_id

    def generate(self, prompts, params: SamplingParams) -> Rollout:
        k = max(1, min(len(self.engines), len(prompts)))
        starts = [i * len(prompts) // k for i in range(k + 1)]
        # vLLM seeds request i with seed + i: its per-prompt seeds stay those of one unsplit call (the HF engine
        # seeds one generator per call, so its pass@k samples depend on the split)
        refs = [e.handle.generate.remote(list(prompts[a:b]), params if params.seed is None else
                                         replace(params, seed=params.seed + a))
                for e, a, b in zip(self.engines, starts, starts[1:])]
        parts = patient_get(refs, self.engines[:k])
        out = parts[0]
        for part in parts[1:]:
            out = concat_rollouts(out, part, self.pad_id)
        return out

    def load_weights(self, named_tensors) -> None:
        raise TypeError("the rollout engines receive the actor's weights through the Ray weight sink, not here")


class RayWeightSink:
    """Collective over the actor group; rank 0 broadcasts the full weights to every engine, versioned."""

    def __init__(self, actor: Actor, env: DistEnv, engines: list[Peer], group, timeout_s: float):
        self.actor, self.env, self.engines, self.group, self.timeout_s = actor, env, engines, group, timeout_s
        # the plain model's names (LoRA adapters merged in): all at the first publish, then those that change
        self.out = Outgoing(actor.model)
        self.publish_s = 0.0

    def publish(self, version: int) -> None:
        t0 = time.perf_counter()
        full = self.actor.engine.full_state_dict(main_only=True)  # collective under ZeRO-3 / FSDP2
        names = self.out.names()
        if self.env.is_main:
            refs = [e.handle.receive.remote(BUCKET_BYTES) for e in self.engines]
            self.group.send(self.out.tensors(full, names), version, BUCKET_BYTES, partial=self.out.partial(names))
            got = get(refs, self.engines, self.timeout_s)
            if got != [version] * len(got):
                raise ClusterError(f"rollout engines acknowledged weight versions {got}, expected {version}")
        barrier(self.env)
        self.publish_s = time.perf_counter() - t0


class RaySource(InlineSource):
    """BatchSource of an actor-group rank: the step's rows from the checkpointed sampler, one contiguous
    share per engine, the merged batch, this rank's prompt groups. The data position is checkpointed as
    the in-process source does it (its state_dict / load_state_dict / close)."""

    def __init__(self, sampler: BatchSampler, trainer, env: DistEnv, producers: RayProducers):
        self.sampler, self.trainer, self.env, self.p = sampler, trainer, env, producers
        self.pad_id = trainer.actor.model.config.pad_token_id or 0
        self.started = False

    def next_batch(self, step: int) -> ScoredBatch:
        if not self.started:  # the engines get this run's weights (a resumed run's, or the base ones)
            self.p.sink_.publish(self.trainer.version)
            self.started = True
        batch = self.made(step, self.sampler.next())
        if self.trainer.cfg.algorithm.dynamic_sampling:
            batch = self.refilled(step, batch)
        batch.metrics["ray/publish_s"] = self.p.sink_.publish_s
        return shard_groups(batch, self.env.rank, self.env.world_size)

    def made(self, step: int, index: list[int]) -> ScoredBatch:
        """The batch of dataset rows `index`: one contiguous share per engine, merged."""
        engines = self.p.engines
        shares = [index[i * len(index) // len(engines):(i + 1) * len(index) // len(engines)]
                  for i in range(len(engines))]
        refs = [e.handle.batch.remote(step, s, self.trainer.version, i) for i, (e, s) in enumerate(zip(engines, shares))]
        # each share's metrics describe its first draw (before dynamic sampling keeps some groups): weighed by it
        drawn = [len(s) * self.trainer.cfg.rollout.n for s in shares]
        return merge(patient_get(refs, engines, self.p.timeout_s, self.say(step)), self.pad_id, drawn)

    def refilled(self, step: int, batch: ScoredBatch) -> ScoredBatch:
        """DAPO's extra generation rounds (of data.gen_batch_size prompts) over the engines' filtered shares, up to
        algorithm.max_gen_rounds, until data.train_batch_size groups are kept; then the earliest that many, or all
        of them when still short. The metrics stay the first draw's, as the in-process loop keeps them."""
        cfg = self.trainer.cfg
        want, rounds, first = cfg.data.train_batch_size, 1, batch.metrics
        while groups_in(batch) < want and rounds <= cfg.algorithm.max_gen_rounds:
            batch = merge([batch, self.made(step, self.sampler.next())], self.pad_id, [1, 1])
            rounds += 1
        kept = min(groups_in(batch), want)
        trained = kept - kept % self.env.world_size  # every rank trains an equal share (shard_groups)
        if kept < want:
            self.say(step)(f"dynamic sampling kept {kept} of {want} groups after {rounds} generation round(s); "
                           f"training on {trained}")
        batch = keep_first_groups(batch, kept)
        batch.metrics = {**first, "dapo/kept_groups": float(trained), "dapo/gen_rounds": float(rounds)}
        return batch

    def say(self, step: int):
        return (lambda line: print(f"step {step}: {line}", flush=True)) if self.env.rank == 0 else (lambda line: None)


class RayProducers:
    """The runner's RemoteProducers for the Ray placement: rollout-engine actors make the batches and
    receive the weights. Sent to every actor-group rank (handles only)."""

    def __init__(self, engines: list[Peer], backend: str, timeout_s: float, critic_group=None):
        self.engines, self.backend, self.timeout_s = engines, backend, timeout_s
        self.critic_group = critic_group  # a CriticGroup when the critics have workers of their own
        self.sink_: RayWeightSink | None = None

    def critics(self, cfg, resume, env: DistEnv):
        """In the critic group's workers when it has them, else in the actor ranks beside the policy."""
        if self.critic_group is not None:
            return self.critic_group.critics(cfg, resume, env)
        return build_critics(cfg, resume, env)

    def sink(self, actor: Actor, env: DistEnv) -> RayWeightSink:
        from alignrl.placements.ray.weight_broadcast import BroadcastGroup

        group = None
        if env.is_main:  # rank 0 serves the weight group's store; the engines join it
            host = ray.util.get_node_ip_address()
            port = free_port(host)
            size = len(self.engines) + 1
            refs = [e.handle.join.remote(host, port, size, self.backend, self.timeout_s) for e in self.engines]
            group = BroadcastGroup(host, port, 0, size, self.backend, self.timeout_s, env.device)
            get(refs, self.engines, self.timeout_s)
        self.sink_ = RayWeightSink(actor, env, self.engines, group, self.timeout_s)
        return self.sink_

    def source(self, sampler: BatchSampler, trainer, env: DistEnv) -> RaySource:
        return RaySource(sampler, trainer, env, self)

    def evaluator(self, pad_id: int) -> RayEvalEngine:
        return RayEvalEngine(self.engines, pad_id)


def died_meanwhile(pending: dict, grace_s: float = 5.0):
    """The worker (actor rank or other) whose pending call (`pending`: ref -> worker) shows it died by now
    or within `grace_s`, if any, looked at call by call (a death already known ends the wait). A collective
    fails on every rank when one member dies, often before Ray reports the death: the dead worker is the
    cause, and the one line should name it rather than a survivor's lost connection."""
    deadline, left = time.monotonic() + grace_s, list(pending)
    while left:
        done, left = ray.wait(left, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            return None
        try:
            ray.get(done[0])
        except ray.exceptions.RayActorError:
            return pending[done[0]]
        except ray.exceptions.RayError:
            continue
    return None
