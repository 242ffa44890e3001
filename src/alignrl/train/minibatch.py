"""The PPO update loop shared by the actor and the critic: epochs × shuffled mini-batches, each one
optimizer step accumulated over length-grouped micro-batches. A mini-batch whose loss or gradient norm
is non-finite is skipped (no optimizer or lr step) and counted.

The micro-batch loss receives the mini-batch's token count, so token-mean losses accumulate to exactly
the mini-batch loss whatever the micro-batch size. Under data parallelism `exp` is this rank's share and
the counts are summed over ranks first, so the loss is the global mini-batch's whatever the world size.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from alignrl.core.aggregation import n_sequences
from alignrl.data.collate import chunk_tokens, length_sorted_chunks, prompt_groups
from alignrl.data.records import Experience
from alignrl.runtime.env import DistEnv, all_reduce_sum
from alignrl.runtime.lanes import in_job_order, lane_sums, lanes_of, run_lanes
from alignrl.interfaces import TrainEngine

SKIPPED = "skipped_nonfinite"  # the metric counting skipped steps, under each model's prefix

# (rows of the full batch, those rows as a trimmed Experience, mini-batch token count, mini-batch
# sequence count) -> (loss, metrics)
MicroLoss = Callable[[torch.Tensor, Experience, float, float], tuple[torch.Tensor, dict[str, float]]]
# a loss of its own given a micro-batch's share of its mini-batch's tokens, and its metrics (MicroRun.follow)
FollowLoss = Callable[[float], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class TokenBudget:
    """Micro-batches by a token budget instead of a row count (verl's use_dynamic_bsz with its
    ppo_max_token_len_per_gpu): each holds as many length-sorted rows as fit in `tokens`, padding included. The
    micro-batch losses take the mini-batch's token count, so the gradient is the fixed split's."""

    tokens: int


def minibatch_updates(exp: Experience, micro_loss: MicroLoss, engine: TrainEngine, mini_batch: int,
                      micro_batch: int | TokenBudget, epochs: int, generator: torch.Generator, prefix: str,
                      by_prompt: bool = False, lanes: int = 1, follow: FollowLoss | None = None) -> dict[str, float]:
    """Runs the updates; `mini_batch` is this rank's share of a mini-batch, in sequences (`micro_batch`: rows, or
    a TokenBudget); `by_prompt` keeps the
    rows of a prompt in the same mini- and micro-batches (for a shared-prompt forward); `lanes` > 1: micro-batches
    side by side where the engine takes it (`runtime.lanes`); `follow`: a loss backpropagated after each micro-batch
    (`MicroRun.follow`, PPO-ptx's). Returns metrics
    averaged over mini-batches (each weighted 1), and `<prefix>/skipped_nonfinite`: the optimizer steps
    skipped because the loss or the gradient norm was non-finite (see `TrainEngine.step`)."""
    sums: dict[str, list[float]] = defaultdict(list)
    skipped_before = engine.skipped_steps
    group = prompt_groups(exp.prompt_ids, exp.prompt_mask)[1] if by_prompt else None  # each row's prompt
    side_by_side = lanes > 1 and engine.parallel_micro_batches and exp.images is None and follow is None
    for _ in range(epochs):
        order = shuffled_rows(len(exp), generator, group)
        for start in range(0, len(exp), mini_batch):
            mb = order[start:start + mini_batch]
            local_tokens = float(exp.response_mask[mb].sum())
            tokens, seqs = all_reduce_sum(engine.env, [local_tokens, n_sequences(exp.response_mask[mb])])
            chunks = micro_batches(mb, exp, micro_batch, group, engine.env)
            run = MicroRun(exp, micro_loss, engine, tokens, seqs, follow)
            done = run.in_lanes(chunks, lanes) if side_by_side and len(chunks) > 1 else run.one_by_one(chunks)
            for finite, tokens_in, m in done:
                for k, v in m.items():
                    sums[k].append(v * tokens_in / max(local_tokens, 1.0))
            # every rank must skip the same steps, or the replicas' weights part ways
            bad_loss = all_reduce_sum(engine.env, [float(sum(not f for f, _, _ in done))])[0]
            sums[f"{prefix}/grad_norm"].append(engine.step(skip=bad_loss > 0))
    n_mini = optimizer_steps(len(exp), mini_batch, epochs)
    out = {k: sum(v) / n_mini for k, v in sums.items()}
    out[f"{prefix}/lr"] = engine.lr()
    out[f"{prefix}/{SKIPPED}"] = float(engine.skipped_steps - skipped_before)
    return out


@dataclass
class MicroRun:
    """The micro-batches of one mini-batch, each's loss backpropagated: one after the other through the engine's
    backward, or side by side. Each gives (loss finite, its response tokens, its metrics), in micro-batch order."""

    exp: Experience
    micro_loss: MicroLoss
    engine: TrainEngine
    tokens: float  # the mini-batch's response tokens and sequences over all ranks
    seqs: float
    # after each micro-batch, a loss of its own given the micro-batch's share of the mini-batch's tokens, with its
    # metrics (PPO-ptx's language-model term): backpropagated into the same optimizer step
    follow: FollowLoss | None = None

    def _loss(self, rows: torch.Tensor) -> tuple[torch.Tensor, tuple[bool, float, dict[str, float]]]:
        micro = self.exp.select(rows).to(self.engine.env.device)
        loss, m = self.micro_loss(rows, micro, self.tokens, self.seqs)
        return loss, (bool(torch.isfinite(loss.detach())), float(micro.response_mask.sum()), m)

    def one_by_one(self, chunks: list[torch.Tensor]) -> list[tuple[bool, float, dict[str, float]]]:
        done = []
        for i, rows in enumerate(chunks):
            last = i == len(chunks) - 1
            with self.engine.micro_batch(last and self.follow is None):
                loss, result = self._loss(rows)
                self.engine.backward(loss, last_micro=last and self.follow is None)
            done.append(result if self.follow is None else self._followed(result, last))
        return done

    def _followed(self, result: tuple[bool, float, dict[str, float]], last: bool
                  ) -> tuple[bool, float, dict[str, float]]:
        finite, tokens_in, metrics = result
        with self.engine.micro_batch(last):
            loss, extra = self.follow(tokens_in / max(self.tokens, 1.0))
            self.engine.backward(loss, last_micro=last)
        return finite and bool(torch.isfinite(loss.detach())), tokens_in, {**metrics, **extra}

    def in_lanes(self, chunks: list[torch.Tensor], lanes: int) -> list[tuple[bool, float, dict[str, float]]]:
        """Each lane sums its micro-batches' gradients in order (`autograd.grad`, never into `.grad` from two
        threads); the lanes' sums are added in lane order: the same result whatever the timing."""
        params = self.engine.params

        def lane(part: list[int]):
            grads: list[torch.Tensor | None] = [None] * len(params)
            results = []
            for i in part:
                loss, result = self._loss(chunks[i])
                got = torch.autograd.grad(loss, params, allow_unused=True)
                grads = lane_sums([grads, list(got)])
                results.append(result)
            return grads, results

        plan = lanes_of(chunk_tokens(chunks, self.exp.prompt_mask, self.exp.response_mask), lanes)
        done = run_lanes([lambda part=part: lane(part) for part in plan])
        self.engine.add_gradients(lane_sums([grads for grads, _ in done]))
        return in_job_order(plan, [results for _, results in done])


def micro_batches(rows: torch.Tensor, exp: Experience, micro: int | TokenBudget, group: torch.Tensor | None,
                  env: DistEnv) -> list[torch.Tensor]:
    """The mini-batch `rows` in length-sorted micro-batches: `micro` rows each, or within a TokenBudget."""
    if not isinstance(micro, TokenBudget):
        return length_sorted_chunks(rows, exp.prompt_mask, exp.response_mask, micro, group)
    ordered = torch.cat(length_sorted_chunks(rows, exp.prompt_mask, exp.response_mask, max(len(rows), 1), group))
    lengths = (exp.prompt_mask[ordered].sum(-1) + exp.response_mask[ordered].sum(-1)).tolist()
    chunks = budget_split(ordered, lengths, micro.tokens)
    # every rank runs as many micro-batches as the one that needs most: ZeRO-3 gathers weights at each forward
    want = int(all_reduce_sum(env, [float(len(chunks))], op=dist.ReduceOp.MAX)[0])
    while len(chunks) < want:  # the largest split in two (each rank has as many rows, so one always splits)
        big = max(range(len(chunks)), key=lambda i: len(chunks[i]))
        half = (len(chunks[big]) + 1) // 2
        chunks[big:big + 1] = [chunks[big][:half], chunks[big][half:]]
    return chunks


def budget_split(ordered: torch.Tensor, lengths: list[int], budget: int) -> list[torch.Tensor]:
    """Consecutive runs of `ordered` whose padded size (rows x longest row) stays within `budget`; a row longer
    than the budget goes alone."""
    chunks, start, longest = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and (i - start + 1) * max(longest, n) > budget:
            chunks.append(ordered[start:i])
            start, longest = i, 0
        longest = max(longest, n)
    return chunks + [ordered[start:]] if len(ordered) else chunks


def shuffled_rows(rows: int, generator: torch.Generator, group: torch.Tensor | None) -> torch.Tensor:
    """A random order of the rows; given `group` (each row's prompt, from `prompt_groups`): a random order of
    the prompts, each followed by all its rows (so a mini-batch of whole prompts' samples holds each prompt
    once, as a shared-prompt forward wants)."""
    if group is None:
        return torch.randperm(rows, generator=generator)
    place = torch.empty(int(group.max()) + 1 if rows else 0, dtype=torch.long)
    place[torch.randperm(len(place), generator=generator)] = torch.arange(len(place))
    return torch.argsort(place[group], stable=True)


def optimizer_steps(rows: int, mini_batch: int, epochs: int) -> int:
    """The optimizer steps `minibatch_updates` takes on `rows` sequences."""
    return epochs * ((rows + mini_batch - 1) // mini_batch)
