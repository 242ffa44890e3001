"""Process groups for torchrun launches, and the one-process fallback without torchrun.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; without them everything runs
in one process (the torchrun scripts' fallback). Process groups always get a timeout, so a rank
waiting on a dead peer raises instead of hanging; torchrun's agent then stops the other ranks and
exits non-zero. Collectives here move tensors only: nothing is pickled between ranks.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings
import zlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from alignrl.errors import ConfigError, program

DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # None: no process group (one process)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


SINGLE = DistEnv()


_interrupted = False
_finished = False  # the rank's main returned: it is exiting, with its line said


def finished() -> None:
    """The rank's work is over (its exit code known): a SIGTERM from torchrun's agent now ends it quietly, where
    SystemExit raised inside an interpreter-exit callback printed a traceback after the run's one line."""
    global _finished
    _finished = True


def _on_sigint(signum, frame):
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def _quiet_lost_interrupt(unraisable) -> None:
    """sys.unraisablehook: a Ctrl-C's KeyboardInterrupt raised inside a finalizer or weakref callback is swallowed
    by Python, which prints it as "Exception ignored ... Traceback" after the rank's one line; the loop stops the
    rank anyway (`interrupted`), so that one is not printed. Every other unraisable exception is, as Python would."""
    if issubclass(unraisable.exc_type, KeyboardInterrupt) and _interrupted:
        return
    sys.__unraisablehook__(unraisable)


def interrupted() -> bool:
    """A Ctrl-C reached this rank. Its KeyboardInterrupt can be lost: raised while Python runs a finalizer or a
    weakref callback (an import lock's, say), it is printed as "Exception ignored" and the rank runs on. The loop
    asks here at each step, and a rank that then finds its peers gone knows they stopped for the same Ctrl-C."""
    return _interrupted


def _on_sigterm(signum, frame):  # torchrun's agent terminates the survivors when a rank fails
    if _interrupted:  # after a Ctrl-C this rank is already stopping (rank 0 says so): let it finish (Python runs a
        return  # pending SIGINT's handler before SIGTERM's); torchrun's agent kills a rank that does not stop
    if _finished:
        os._exit(1)
    print(f"{program()}: rank {os.environ.get('RANK', '?')}: stopped by SIGTERM (another rank failed, or the launcher "
          "stopped the run: its line says why)", file=sys.stderr)
    sys.exit(1)


def cuda_bf16() -> bool:
    """A CUDA device that computes in bf16 is here."""
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def quiet_deepspeed() -> None:
    """DeepSpeed's noise in a run that is not wrong. Without CUDA, DeepSpeed warns "Setting accelerator to CPU"
    when it is imported, which a run does even without trainer.strategy=deepspeed (transformers' save_pretrained
    imports it through accelerate): DS_ACCELERATOR=cpu says it first, unless the user set it. And DeepSpeed's
    ZeRO calls torch.distributed.all_gather_into_tensor and reduce_scatter_tensor, which each rank's torch then warns
    are deprecated."""
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is "
                            "deprecated", category=FutureWarning)


def init_distributed(device: str = "auto", timeout_s: float | None = None) -> DistEnv:
    """Joins the torchrun process group (gloo on CPU, NCCL on GPUs); one process without torchrun.
    `timeout_s` (default $ALIGNRL_DIST_TIMEOUT or 600) bounds every collective. A torchrun rank dies with
    torchrun's agent, however the agent dies (alignrl.runtime.lifetime)."""
    from alignrl.runtime.lifetime import rank_dies_with_agent

    rank_dies_with_agent()  # first: a rank whose agent was killed while it started stops here
    quiet_deepspeed()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device == "cuda" and not torch.cuda.is_available():  # else the run would quietly train on the CPU
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ConfigError(f"trainer.device=cuda, but torch {torch.__version__} sees no CUDA device"
                          f"{f' (CUDA_VISIBLE_DEVICES={hidden!r})' if hidden is not None else ''}: use "
                          "trainer.device=auto or cpu, or a CUDA build of torch on a machine with a GPU")
    use_cuda = torch.cuda.is_available() and device != "cpu"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda and local_rank >= torch.cuda.device_count():  # else CUDA's "invalid device ordinal" traceback
        n = torch.cuda.device_count()
        raise ConfigError(f"rank {os.environ.get('RANK', '?')} is local rank {local_rank}, but this node has {n} "
                          f"CUDA device(s): start at most {n} rank(s) per node (--nproc, --nproc_per_node), one "
                          "per GPU, or train on the CPU (trainer.device=cpu, CUDA_VISIBLE_DEVICES=)")
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if world <= 1:
        return DistEnv(device=dev)
    if not dist.is_initialized():
        timeout = timeout_s if timeout_s is not None else float(os.environ.get("ALIGNRL_DIST_TIMEOUT",
                                                                               DEFAULT_TIMEOUT_S))
        try:
            join_group(dev, timedelta(seconds=timeout))
        except dist.DistNetworkError as e:  # most often: the master port is taken (launchers that are not ours)
            where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"rank {os.environ.get('RANK', '?')}: the process group's rendezvous at {where} failed "
                              f"({first}); pick a free port (training.master_port, MASTER_PORT) or check the master "
                              "host") from None
        signal.signal(signal.SIGTERM, _on_sigterm)
        signal.signal(signal.SIGINT, _on_sigint)
        sys.unraisablehook = _quiet_lost_interrupt
    return DistEnv(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=dev,
                   backend=dist.get_backend())


def join_group(dev: torch.device, timeout: timedelta | None = None) -> None:
    """Joins the env:// process group: NCCL on a GPU, told that GPU up front (else it guesses one from the global
    rank, warning that another rank-to-GPU mapping can hang, and every barrier warns too); gloo on the CPU.
    `timeout`: torch's default when None."""
    nccl = dev.type == "cuda"
    dist.init_process_group("nccl" if nccl else "gloo", **({"timeout": timeout} if timeout else {}),
                            **({"device_id": dev} if nccl else {}))


def shutdown() -> None:
    if dist.is_initialized():
        # gloo's worker threads free a finished collective's tensors under the GIL, and the process group's
        # destructor (run when DDP's reducer, which holds the group too, is freed) joins them while holding it: a
        # rank then hung at exit right after the final barrier. Sleeping releases the GIL so they finish first.
        time.sleep(0.05)
        dist.destroy_process_group()


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def all_reduce_sum(env: DistEnv, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
    """Sums (or another `op`) of `values` over ranks (one collective for the whole list)."""
    if not env.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=env.device if env.backend == "nccl" else "cpu")
    dist.all_reduce(t, op=op)
    return t.tolist()


def gather_values(env: DistEnv, values: list[float]) -> list[float]:
    """Every rank's `values`, in rank order, on every rank (the lists may differ in length)."""
    return gather_tensor(env, torch.tensor(values, dtype=torch.float64)).tolist()


def gather_tensor(env: DistEnv, values: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D `values`, concatenated in rank order, on every rank, on `values`' device (the lengths
    may differ): the lengths first, then one all_gather of the tensors padded to the longest, as all_gather
    wants equal shapes."""
    if not env.distributed:
        return values
    counts = [0.0] * env.world_size
    counts[env.rank] = float(values.numel())
    counts = [int(c) for c in all_reduce_sum(env, counts)]
    if not any(counts):
        return values.reshape(-1)
    dev = env.device if env.backend == "nccl" else torch.device("cpu")
    padded = torch.zeros(max(counts), dtype=values.dtype, device=dev)
    padded[:values.numel()] = values.detach().reshape(-1)
    pieces = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(pieces, padded)
    return torch.cat([piece[:n] for piece, n in zip(pieces, counts)]).to(values.device)


def gather_bytes(env: DistEnv, blob: bytes) -> list[bytes]:
    """Every rank's `blob`, in rank order, on every rank: each rank's bytes at its own offset of one zero tensor,
    summed (tensors only, so nothing is unpickled)."""
    if not env.distributed:
        return [blob]
    sizes = [int(n) for n in gather_values(env, [float(len(blob))])]
    start = sum(sizes[:env.rank])
    placed = torch.zeros(sum(sizes), dtype=torch.uint8)
    if blob:
        placed[start:start + len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    placed = placed.to(env.device if env.backend == "nccl" else "cpu")
    dist.all_reduce(placed)
    data = placed.cpu().numpy().tobytes()
    return [data[sum(sizes[:r]):sum(sizes[:r + 1])] for r in range(env.world_size)]


def sum_over_ranks(env: DistEnv):
    """A function summing a small tensor over ranks (for batch-wide statistics), or None in one process."""
    if not env.distributed:
        return None

    def total(t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone().to(env.device if env.backend == "nccl" else "cpu")
        dist.all_reduce(out)
        return out.to(t.device)

    return total


SUMMED = ("perf/tokens_per_s", "reward/timeouts")  # each rank's share of the run's rate, of the step's rows


def mean_metrics(env: DistEnv, metrics: dict[str, float]) -> dict[str, float]:
    """Each metric reduced over ranks: a `*_max` the largest, a `*_min` the smallest, a rate in SUMMED the sum, the
    others the mean. Keys every rank has are reduced; a key missing on some rank keeps rank 0's value (metrics are
    for logging; the loss never goes through here)."""
    if not env.distributed:
        return metrics
    keys = sorted(metrics)
    # ranks agree on the key set when the sums of a per-key hash and the counts match
    sig = [float(len(keys)), float(sum(zlib.crc32(k.encode()) % 1_000_003 for k in keys))]
    total = all_reduce_sum(env, sig)
    if total != [s * env.world_size for s in sig]:
        return metrics
    sums = all_reduce_sum(env, [float(metrics[k]) for k in keys])
    out = {k: s if k in SUMMED else s / env.world_size for k, s in zip(keys, sums)}
    extreme = [k for k in keys if k.endswith(("_max", "_min"))]
    if extreme:  # one MAX collective: a minimum is the negated maximum of the negated values
        sign = [1.0 if k.endswith("_max") else -1.0 for k in extreme]
        top = all_reduce_sum(env, [s * float(metrics[k]) for s, k in zip(sign, extreme)], dist.ReduceOp.MAX)
        out.update({k: s * v for s, k, v in zip(sign, extreme, top)})
    return out


def shard(items: list, env: DistEnv) -> list:
    """This rank's contiguous share of a global batch (DistributedSampler's split, without padding:
    callers make the batch divisible by the world size)."""
    per = len(items) // env.world_size
    return items[env.rank * per:(env.rank + 1) * per]


def broadcast_frames(frames: list | None, env: DistEnv) -> list[bytes]:
    """Rank 0's message frames on every rank (rank 0 passes them, the others None). Tensors only: the
    frame sizes, then the bytes; the receivers decode them with `alignrl.wire.frames` like rank 0 did."""
    dev = env.device if env.backend == "nccl" else torch.device("cpu")
    sizes = torch.tensor([len(memoryview(f)) for f in frames] if env.is_main else [], dtype=torch.int64)
    count = torch.tensor([len(sizes)], dtype=torch.int64, device=dev)
    dist.broadcast(count, 0)
    sizes = sizes.to(dev) if env.is_main else torch.zeros(int(count), dtype=torch.int64, device=dev)
    dist.broadcast(sizes, 0)
    blob = bytearray(b"".join(bytes(memoryview(f)) for f in frames)) if env.is_main else b""
    data = (torch.frombuffer(blob, dtype=torch.uint8).to(dev) if blob else
            torch.empty(int(sizes.sum()), dtype=torch.uint8, device=dev))
    dist.broadcast(data, 0)
    cpu = data.cpu().numpy().tobytes()
    out, at = [], 0
    for n in sizes.tolist():
        out.append(cpu[at:at + n])
        at += n
    return out
