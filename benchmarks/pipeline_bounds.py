"""The bounds `async_vs_sync.py` prints under its table, from the runs' own metrics rows (a run here is its
`Result`: `.ok`, and `.rows`, the metrics.jsonl rows of steps >= 1)."""

from __future__ import annotations

import statistics


def mean_of(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else None


def mean_step(run) -> float:
    """The run's mean s/step over steps 2..S (step 1 is warm-up)."""
    return statistics.mean(x["timing/step"] for x in run.rows if x["step"] >= 2)


def stages(run) -> tuple[float, float, float]:
    """(step, trainer wait, sampler work) seconds of a pipeline run, means over steps 2..S: the trainer's own work
    is its step less its wait for a batch; the sampler's is one batch's generation, reference log-probs and reward."""
    timed = [x for x in run.rows if x["step"] >= 2]
    step, wait = statistics.mean(x["timing/step"] for x in timed), mean_of(timed, "pipeline/trainer_wait_s") or 0.0
    sampler = sum(mean_of(timed, f"timing/{k}") or 0.0 for k in ("gen", "ref", "reward", "old_logprob"))
    return step, wait, sampler


def print_k1_bound(k1, base) -> None:
    """Where the k=1 step goes, and the bound of a two-stage pipeline measured in the same run: a step cannot
    take less than the slower stage, the trainer's own work or the sampler's work on one batch."""
    step, wait, sampler = stages(k1)
    base_step = mean_step(base)
    slower = max(step - wait, sampler)
    print(f"zmq k=1: the trainer waits {wait:.3f} s of its {step:.3f} s/step for batches "
          f"({'trainer' if step - wait >= sampler else 'sampler'}-bound); stages: trainer {step - wait:.3f} s/step, "
          f"sampler {sampler:.3f} s/batch")
    print(f"bound: the slower stage allows {base_step / slower:.2f}x in-process; measured "
          f"{base_step / step:.2f}x ({slower / step:.0%} of the bound)")


def print_core_bound(owns: list, bases: list, cores: int, target: float) -> None:
    """The bound of any placement of the two stages on this machine, per round, from the run whose processes keep
    one thread each (`zmq k=1 own cores`) and the in-process run of the same round: a step's work takes at least
    its one-thread core-seconds (a second thread never does more than the first), and `cores` cores give at
    most `cores` core-seconds a second."""
    rounds = []
    for own, base in zip(owns, bases):
        if own.ok and base.ok:
            step, wait, sampler = stages(own)
            rounds.append((mean_step(base) / ((step - wait + sampler) / cores), step - wait, sampler))
    if not rounds:
        return
    best, trainer, sampler = sorted(rounds)[(len(rounds) - 1) // 2]
    print(f"machine bound: a step's work is {trainer + sampler:.3f} core-s on one thread per process (trainer "
          f"{trainer:.3f}, sampler {sampler:.3f}); on {cores} cores no placement of it steps faster than "
          f"{(trainer + sampler) / cores:.3f} s: at most {best:.2f}x in-process (rounds: "
          f"{', '.join(f'{r[0]:.2f}x' for r in rounds)}; {'below' if best < target else 'above'} the "
          f"{target:.1f}x target)")
