"""The worker-group Ray actors: an actor-group rank (the trainer side of the loop), a reference worker,
a reward-model worker, a rollout engine (the producer side). Each is a plain class made a Ray actor by the driver
(`ray.remote(cls).options(...)`); the classes themselves only build the loop's existing pieces.

Every worker has a `watch` method in a concurrency group of its own: it returns only when the worker
stops, so the driver learns of a dead worker (kill -9, OOM) from that call failing, even while the
worker is busy in its default thread.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from alignrl.config import RunConfig

WATCH = {"watch": 1}


def config_of(text: str) -> RunConfig:
    """The driver's resolved run config from its YAML (already checked and counted there: loading it
    again through `load_config` would redo verl's step arithmetic)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.create(text)))


def node_label() -> str:
    """The node as the error lines name it: IP and the first characters of Ray's node id."""
    ctx = ray.get_runtime_context()
    return f"{ray.util.get_node_ip_address()} ({ctx.get_node_id()[:8]})"


def device_for(local_rank: int) -> torch.device:
    """The first GPU Ray assigned to this worker (all of the node's GPUs stay visible, so the id is the
    node's), else the one at this worker's position on its node; the CPU without CUDA."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    ids = ray.get_gpu_ids()
    return torch.device("cuda", int(ids[0]) if ids else local_rank)


def join_group(rank: int, world: int, local_rank: int, master: tuple[str, int], timeout_s: float) -> torch.device:
    """This worker as rank `rank` of a `world`-rank torch.distributed group whose rank 0 serves `master`: the
    launcher's environment variables set, as the loop's init_distributed reads them, and with more than one rank the
    group joined here (the loop's own join installs signal handlers, which only a main thread may, and Ray runs
    calls on another). Returns the worker's device."""
    dev = device_for(local_rank)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(dev.index if dev.type == "cuda" else
                                                                             local_rank),
                      MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), ALIGNRL_DIST_TIMEOUT=str(timeout_s))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))
    return dev


class Worker:
    """What every worker has: a name for error lines, a liveness call, its threads."""

    def __init__(self, threads: int):
        if threads:
            torch.set_num_threads(threads)
        self._stop = threading.Event()

    def where(self) -> dict:
        return {"node": node_label(), "pid": os.getpid(), "ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id()}

    def free_address(self) -> tuple[str, int]:
        """This node's IP and a free port on it (a group's rank 0 serves its rendezvous; actor rank 0 the
        weight store too)."""
        from alignrl.runtime.ports import free_port

        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    @ray.method(concurrency_group="watch")
    def watch(self) -> None:
        self._stop.wait()

    def stop(self) -> None:
        self._stop.set()


class PolicyRank(Worker):
    """Rank `rank` of the actor group: torch.distributed with the other ranks (gloo on CPU, NCCL on
    GPUs) through the usual environment variables, then the one training loop."""

    def __init__(self, rank: int, world: int, local_rank: int, threads: int, peer_timeout_s: float):
        super().__init__(threads)
        self.rank, self.world, self.local_rank, self.peer_timeout_s = rank, world, local_rank, peer_timeout_s

    def run(self, cfg_text: str, master: tuple[str, int], producers, env: dict[str, str] | None = None
            ) -> dict | None:
        """`env`: variables the loop needs that stay out of the config text (the wandb key rank 0 logs with)."""
        from alignrl.runner import train_grpo

        os.environ.update(env or {})
        join_group(self.rank, self.world, self.local_rank, master, self.peer_timeout_s)  # the loop picks cuda:LOCAL_RANK
        try:
            return train_grpo(config_of(cfg_text), producers=producers)
        finally:
            self.stop()


class RefWorker(Worker):
    """Rank `rank` of the reference group: a frozen copy of the base policy scoring reference log-probs (the
    loop's `build_ref`), or, sharded (`build` given the group's rendezvous), this rank's shard of one copy held
    by the whole group (`dist.sharded_ref`), as OpenRLHF's reference group holds it under ZeRO-3."""

    def __init__(self, cfg_text: str, rank: int, world: int, local_rank: int, threads: int, peer_timeout_s: float):
        super().__init__(threads)
        self.cfg, self.rank, self.world, self.local_rank = config_of(cfg_text), rank, world, local_rank
        self.timeout_s, self.scorer = peer_timeout_s, None

    def build(self, master: tuple[str, int] | None) -> int:
        """Loads the reference; with `master` (reference rank 0's address) joins the group's torch.distributed
        and keeps only this rank's shard. Returns the parameter elements this worker holds."""
        from alignrl.placements.build import build_ref
        from alignrl.runtime.env import init_distributed
        from alignrl.models.sharded_load import held_elements
        from alignrl.placements.sharded_ref import build_sharded_ref

        if master is None:
            self.scorer = build_ref(self.cfg, device_for(self.local_rank))
        else:  # sharded: more than one rank
            join_group(self.rank, self.world, self.local_rank, master, self.timeout_s)
            self.scorer = build_sharded_ref(self.cfg, init_distributed(self.cfg.trainer.device))
        return held_elements(self.scorer.model)

    def logprobs(self, prompt_ids, prompt_mask, response_ids, response_mask,
                 images: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Reference log-probs of the rows; `images`: their prompt images as `wire.records.images_to_wire`'s flat
        tensors (RayRefScorer sends them so)."""
        from alignrl.wire.records import images_from_wire

        extra = {} if images is None else {"images": images_from_wire(images, len(prompt_ids))}
        return self.scorer.logprobs(prompt_ids, prompt_mask, response_ids, response_mask, **extra).cpu()


class RewardWorker(Worker):
    """The reward model (`--reward_pretrain`, algorithm.reward_model) in a worker of its own: the loop's
    ModelScorer on this worker's device, scoring the rows a rollout engine sends."""

    def __init__(self, cfg_text: str, local_rank: int, threads: int):
        from alignrl.models.value import ModelScorer

        super().__init__(threads)
        cfg = config_of(cfg_text)
        # what the normalization reads from the folder is said at start: Ray shows a worker's output
        say = (lambda line: print(line, flush=True)) if cfg.algorithm.reward_model_normalize else (lambda *_: None)
        self.scorer = ModelScorer(cfg.algorithm.reward_model, cfg.model.dtype, log=say, device=device_for(local_rank),
                                  normalize=cfg.algorithm.reward_model_normalize)

    def score(self, prompt_ids, prompt_mask, response_ids, response_mask) -> torch.Tensor:
        return self.scorer.score(prompt_ids, prompt_mask, response_ids, response_mask)


@dataclass(frozen=True)
class EngineSpec:
    """Which engine a rollout worker runs: `kind` "hf" (the embedded engine on its own copy of the policy) or
    "vllm" (tensor-parallel size `tp`, taking `gpu_memory_utilization` of its GPU)."""

    kind: str = "hf"
    tp: int = 1
    gpu_memory_utilization: float = 0.6


def load_engine(cfg: RunConfig, device: torch.device, spec: EngineSpec):
    """The engine, its tokenizer, the policy's parameters as the actor sends them, and the HF model the engine
    runs (None for vLLM, which holds no HF copy)."""
    if spec.kind == "vllm":
        return (*vllm_engine(cfg, spec.tp, spec.gpu_memory_utilization), None)
    from alignrl.config.agent_checks import needs_chat_template
    from alignrl.models.loader import load_model
    from alignrl.rollout.hf_engine import HFRolloutEngine

    model, tokenizer = load_model(cfg.model.path, cfg.model.dtype, chat=needs_chat_template(cfg))
    model = model.to(device)
    return HFRolloutEngine(model, tokenizer), tokenizer, list(model.named_parameters()), model


class RolloutWorker(Worker):
    """A rollout engine (`EngineSpec`: vLLM on GPUs or the embedded HF engine on its own copy of the policy), the
    loop's RolloutMaker (`build_maker`) around it, weights from
    actor rank 0 through the broadcast group."""

    def __init__(self, cfg_text: str, index: int, local_rank: int, threads: int, ref_group, reward_workers: list,
                 spec: EngineSpec = EngineSpec()):
        from alignrl.placements.build import build_ref, producer_prompts

        super().__init__(threads)
        self.cfg, self.index, self.device = config_of(cfg_text), index, device_for(local_rank)
        cfg = self.cfg
        self.engine, self.tokenizer, self.named, model = load_engine(cfg, self.device, spec)
        # `ref_group`: the reference group (a RayRefScorer over its workers); else (no group of its own) the
        # loop's own choice: none without a KL term, the reference service when configured, a frozen base copy
        # in this engine otherwise
        if ref_group is not None:
            self.ref = ref_group
        else:
            # a vLLM engine holds no HF copy (model None): build_ref loads one if the reference is frozen here
            self.ref = build_ref(cfg, self.device, model)
        self.reward_workers = reward_workers
        _, self.rows = producer_prompts(cfg, self.tokenizer)
        self.makers: dict[int, object] = {}
        self.version, self.group, self.cached = 0, None, None

    def maker(self, seed_rank: int):
        """One maker per seed rank: `seed_rank` decorrelates the samples of the engines' shares. With a
        reward group, the loop's reward stage scores through it instead of loading the model here."""
        from alignrl.placements.build import build_maker
        from alignrl.placements.episodes import with_tools
        from alignrl.placements.ray.channel import RayRewardScorer

        if seed_rank not in self.makers:
            scorer = (RayRewardScorer(self.reward_workers, self.cfg.algorithm.reward_model) if self.reward_workers
                      else None)
            # multi-turn search (agent.max_turns > 0) over this engine, as in the in-process loop
            engine = with_tools(self.cfg, self.engine, self.tokenizer)
            self.makers[seed_rank] = build_maker(self.cfg, engine, self.tokenizer, self.ref, self.device, seed_rank,
                                                 reward_model=scorer)
        return self.makers[seed_rank]

    def batch(self, step: int, index: list[int], version: int, seed_rank: int):
        """The scored batch of `step` for dataset rows `index`, made once and handed to every actor rank
        that asks (they all ask for the same one)."""
        key = (step, tuple(index), version)
        if self.cached is None or self.cached[0] != key:
            if version != self.version:
                raise RuntimeError(f"rollout engine {self.index} holds weights v{self.version}, asked for v{version}")
            self.cached = (key, self.maker(seed_rank).make(step, index, self.rows, version))
        return self.cached[1]

    def generate(self, prompts: list[list[int]], params):
        """The held-out evaluation's rollouts (greedy, or pass@k's samples) on this engine's current weights."""
        return self.engine.generate(prompts, params)

    def join(self, host: str, port: int, size: int, backend: str, timeout_s: float) -> None:
        from alignrl.placements.ray.weight_broadcast import BroadcastGroup, manifest

        self.group = BroadcastGroup(host, port, self.index + 1, size, backend, timeout_s, self.device)
        self.manifest = manifest(self.named)

    def receive(self, bucket_bytes: int) -> int:
        version, named = self.group.receive(self.manifest, bucket_bytes)
        self.engine.load_weights(named)
        self.version = version
        return version


def vllm_engine(cfg: RunConfig, tp: int, gpu_memory_utilization: float):
    """A vLLM engine of the base policy, its tokenizer, and the policy's parameters as the actor sends
    them (names, shapes and the actor's dtype, from a model built on the meta device: no memory)."""
    from alignrl.models.loader import meta_model, resolve_model_path, run_tokenizer
    from alignrl.rollout.vllm_engine import VLLMRolloutEngine

    folder = str(resolve_model_path(cfg.model.path, lambda *_: None))
    ids = ray.get_gpu_ids()
    if tp == 1 and ids:
        # workers see all of their node's GPUs (NOSET, see Driver.start) and vLLM takes the first one it
        # sees: without this every one-GPU engine of a node would load onto its GPU 0. (Larger engines hold
        # no GPU themselves; vLLM's Ray executor places their workers on the group's bundles.)
        os.environ["CUDA_VISIBLE_DEVICES"] = str(ids[0])
    engine = VLLMRolloutEngine(folder, tensor_parallel_size=tp, dtype=cfg.model.dtype,
                               gpu_memory_utilization=gpu_memory_utilization,
                               distributed_executor_backend="ray" if tp > 1 else None,
                               min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels)
    # a vision-language folder's tokenizer carries its processor: the worker's prompts with images are encoded by it
    tokenizer = run_tokenizer(cfg, Path(folder))
    return engine, tokenizer, list(meta_model(folder, cfg.model.dtype).named_parameters())
