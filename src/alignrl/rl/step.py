"""One synchronous RL step: the next scored batch from the producer, then the trainer's update.

    BatchSource.next_batch (generate -> reward -> reference)  ->  PolicyTrainer.train (advantages ->
    update -> publish weights)

Every placement runs this same step; what differs is which BatchSource and WeightSink it was built
with (`alignrl.placements.build`). The asynchronous ZeroMQ trainer runs it too: its source hands out
batches that samplers made with weights at most `max_staleness` versions old.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from alignrl.data.records import ScoredBatch
from alignrl.rl.trainer import PolicyTrainer
from alignrl.interfaces import BatchSource


class GRPOStep:
    def __init__(self, source: BatchSource, trainer: PolicyTrainer,
                 dump: Callable[[int, ScoredBatch], None] | None = None):
        """`dump`: told each step's batch (trainer.rollout_data_dir's RolloutDump), on every rank."""
        self.source, self.trainer, self.dump = source, trainer, dump

    def run(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        batch = self.source.next_batch(step)
        metrics = {**batch.metrics, **self.trainer.train(step, batch)}
        if self.dump is not None:
            self.dump(step, batch)
        elapsed = time.perf_counter() - t0
        ro = batch.rollout
        tokens = float(ro.prompt_mask.sum() + ro.response_mask.sum())
        return {**metrics, "timing/step": elapsed, "perf/tokens_per_s": tokens / elapsed}
