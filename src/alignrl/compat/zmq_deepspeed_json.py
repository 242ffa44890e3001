"""The ZeroMQ deepspeed.json: checked before launching (one line for an impossible value), and its batch numbers
made the run's (train_micro_batch_size_per_gpu -> actor.ppo_micro_batch_size; train_batch_size and
gradient_accumulation_steps -> the mini-batch), or written with the run's own."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from alignrl.errors import UserError

DS_FILE = "deepspeed.json"
DS_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# a digest of the rest of the file alignrl wrote: until someone edits it, the file is alignrl's to write again for
# another run (another process count, batch); once edited, it is the user's, and the run follows it
MARK = "written_by_alignrl"


class ZmqScriptError(UserError):
    """A mistake in the ZeroMQ pipeline's flags or deepspeed.json, said in one line before anything starts."""


def run_batch(cfg, world: int) -> dict[str, int]:
    """DeepSpeed's three batch numbers of a run: sequences per optimizer step over all ranks, per forward/backward
    on each rank, and micro-batches per optimizer step (the micro-batch a divisor of each rank's share, so that
    train = micro × world × accumulation holds as DeepSpeed requires)."""
    seqs = cfg.mini_batch_sequences
    per_rank = max(1, seqs // world)
    micro = min(cfg.actor.ppo_micro_batch_size, per_rank)
    micro = max(d for d in range(1, micro + 1) if per_rank % d == 0)
    return {"train_batch_size": micro * world * (per_rank // micro), "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": per_rank // micro}


def ds_problem(ds: object) -> str | None:
    """Obviously wrong values of a DeepSpeed JSON file (each a 51-line ValidationError on every rank otherwise)."""
    if not isinstance(ds, dict):
        return 'must be a JSON object like {"zero_optimization": {"stage": 2}}'
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    for key in DS_BATCH:
        v = ds.get(key, "auto")
        if v != "auto" and not (whole(v) and v >= 1):
            unit = "micro-batches" if key == "gradient_accumulation_steps" else "sequences"
            return f"{key} {json.dumps(v)}: give a whole number of {unit}, 1 or more (or leave it out)"
    zero = ds.get("zero_optimization", {})
    if not isinstance(zero, dict):
        return 'zero_optimization must be an object like {"stage": 2}'
    stage = zero.get("stage", 0)
    if not (whole(stage) and 0 <= stage <= 3):
        return (f"zero_optimization.stage {json.dumps(stage)}: DeepSpeed's ZeRO stages are 0, 1, 2 and 3 (shipped: 2; "
                "3 also shards the parameters when memory runs out)")
    for key in ("offload_optimizer", "offload_param"):
        off = zero.get(key)
        if off is not None and not (isinstance(off, dict) and off.get("device", "none") in ("cpu", "nvme", "none")):
            return (f'zero_optimization.{key} {json.dumps(off)}: give an object like {{"device": "cpu"}} '
                    "(cpu, nvme or none)")
    for key in ("bf16", "fp16"):
        prec = ds.get(key, {})
        if not (isinstance(prec, dict) and prec.get("enabled", False) in (True, False, "auto")):
            return f'{key} {json.dumps(prec)}: give an object like {{"enabled": true}} (true, false or "auto")'
    if ds.get("bf16", {}).get("enabled") is True and ds.get("fp16", {}).get("enabled") is True:
        return "bf16 and fp16 are both enabled: enable one of them"
    clip = ds.get("gradient_clipping", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
        return f"gradient_clipping {json.dumps(clip)}: give the largest gradient norm, a number >= 0 (0: no clipping)"
    return None


def ds_batch_overrides(ds: dict, cfg, world: int, given: set[str], batch_flag: bool) -> tuple[list[str], str | None]:
    """The config overrides that make the run follow the batch numbers of a DeepSpeed file `ds` (train_batch_size:
    sequences per optimizer step over all ranks -> the mini-batch; train_micro_batch_size_per_gpu: sequences per
    forward/backward on a rank -> actor.ppo_micro_batch_size; gradient_accumulation_steps: micro-batches per
    optimizer step), and one line naming what came from the file (None when it agrees with the run).
    A key left out (or "auto") is worked out from the other two, keeping the run's mini-batch where that is not
    fixed. ZmqScriptError in one line when the numbers disagree with each other or with the run."""
    run = run_batch(cfg, world)
    t, m, g = (ds.get(k) if ds.get(k) != "auto" else None for k in DS_BATCH)
    if (t, m, g) == (None, None, None) or (t, m, g) == tuple(run[k] for k in DS_BATCH):
        return [], None
    procs = f"{world} training process{'es' if world > 1 else ''}"
    if t is not None and m is not None and g is not None and t != m * g * world:
        raise ZmqScriptError(f"train_batch_size {t} is not train_micro_batch_size_per_gpu {m} × "
                           f"gradient_accumulation_steps {g} × {procs} = {m * g * world}: make it so, or leave "
                           "one of the three out (it is then worked out from the others)")
    if t is None:
        t = m * g * world if m is not None and g is not None else run["train_batch_size"]
    if t % world:
        raise ZmqScriptError(f"train_batch_size {t} does not split evenly over {procs}: make it a multiple of {world}")
    per_rank = t // world
    for have, name in ((m, "train_micro_batch_size_per_gpu"), (g, "gradient_accumulation_steps")):
        if have is not None and per_rank % have:
            raise ZmqScriptError(f"{name} {have} does not divide the {per_rank} sequences each of {procs} takes per "
                               f"optimizer step (train_batch_size {t}): give a divisor of {per_rank}")
    from_file = m is not None or g is not None  # else the run's own micro-batch, made a divisor of per_rank
    if m is None:
        cap = min(cfg.actor.ppo_micro_batch_size, per_rank)
        m = per_rank // g if g is not None else max(d for d in range(1, cap + 1) if per_rank % d == 0)
    n, prompts = cfg.rollout.n, cfg.data.train_batch_size
    by_prompts = cfg.actor.ppo_mini_batch_unit == "prompts"
    if by_prompts and t % n:
        raise ZmqScriptError(f"train_batch_size {t} is not a whole number of prompt groups of {n} samples "
                           f"(--group-size): make it a multiple of {n}")
    if (prompts * n) % t:
        raise ZmqScriptError(f"train_batch_size {t} must divide the {prompts * n} sequences of one RL step ({prompts} "
                           f"prompts × {n} samples, --batch-size and --group-size): give a divisor of {prompts * n}")
    if by_prompts and world > 1 and (t // n) % world:
        raise ZmqScriptError(f"train_batch_size {t} is {t // n} prompt groups, which do not split evenly over {procs}: "
                           f"make it a multiple of {n * world}")
    o, said = [], []
    mini = t // n if by_prompts else t
    if t != run["train_batch_size"]:
        if "actor.ppo_mini_batch_size" in given or batch_flag:
            flag = "--batch-size" if batch_flag else "actor.ppo_mini_batch_size"
            raise ZmqScriptError(f"train_batch_size {t} (sequences per optimizer step) differs from the "
                               f"{run['train_batch_size']} that {flag} gives: change one of them, or delete "
                               f"{DS_FILE} to have it written again with this run's values")
        o.append(f"actor.ppo_mini_batch_size={mini}")
        said.append(f"train_batch_size {t} -> actor.ppo_mini_batch_size={mini}")
    if m != min(cfg.actor.ppo_micro_batch_size, per_rank):
        if from_file and "actor.ppo_micro_batch_size" in given:
            raise ZmqScriptError(f"train_micro_batch_size_per_gpu {m} differs from actor.ppo_micro_batch_size="
                               f"{cfg.actor.ppo_micro_batch_size}: change one of them")
        o.append(f"actor.ppo_micro_batch_size={m}")
        said.append(f"train_micro_batch_size_per_gpu {m} -> actor.ppo_micro_batch_size={m}")
    if not o:  # the file's numbers are this run's, spelled otherwise
        return [], None
    if g is not None:
        said.append(f"gradient_accumulation_steps {g}")
    return o, (f"{DS_FILE}: " + ", ".join(said) + f"; each update: {m} sequence(s) × {procs} × {per_rank // m} "
               f"accumulation step(s) = {t} sequences")


def read_ds_json(path: Path) -> dict:
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ZmqScriptError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}): fix it, or delete it to have it "
                           "written again") from None
    except OSError as e:
        raise ZmqScriptError(f"{path}: cannot read it ({e.strerror})") from None
    problem = ds_problem(ds)
    if problem:
        raise ZmqScriptError(f"{path}: {problem}")
    return ds


def _digest(ds: dict) -> str:
    return hashlib.sha256(json.dumps({k: v for k, v in ds.items() if k != MARK}, sort_keys=True).encode()).hexdigest()[:16]


def generated(run: dict[str, int], bf16: bool, grad_clip: float) -> dict:
    """The deepspeed.json alignrl writes for a run's batch numbers `run` (run_batch), marked as its own."""
    ds = {**run, "zero_optimization": {"stage": 2}, "bf16": {"enabled": bf16}, "gradient_clipping": grad_clip}
    return {**ds, MARK: _digest(ds)}


def untouched(ds: dict) -> bool:
    """Whether `ds` is a file alignrl wrote (for this run or an earlier one) that nobody has edited since."""
    return ds.get(MARK) == _digest(ds)
