"""A RolloutEngine that plays scripted turns, for the multi-turn rollouts' tests (Search-R1's agent, environments,
verl's tool loop): each row gets the ids scripted for its prompt and for the number of turns that prompt has seen."""

from __future__ import annotations

from collections.abc import Callable

import torch

from alignrl.data.collate import left_pad, right_pad
from alignrl.data.records import Rollout
from alignrl.interfaces import SamplingParams


def first_id(prompt) -> int:
    return prompt[0]  # each test prompt starts with its own id


class ScriptedEngine:
    """`script[key(prompt)][turn]`: the ids of that turn (cut at max_new_tokens); `truncate`: the (key, turn) pairs
    that end at the length limit. Records every call's (contexts, ids returned); `check(params)` runs on each call.
    Log-probs are distinct negative numbers on the ids returned."""

    def __init__(self, script: dict, truncate=(), key: Callable = first_id, check: Callable | None = None):
        self.script, self.truncate, self.key, self.check = script, set(truncate), key, check
        self.calls: list[tuple[list[list[int]], list[list[int]]]] = []
        self.seen: dict = {}

    def generate(self, prompts, params: SamplingParams) -> Rollout:
        assert params.n == 1
        if self.check is not None:
            self.check(params)
        outs, trunc = [], []
        for p in prompts:
            k = self.key(p)
            turn = self.seen.get(k, 0)
            self.seen[k] = turn + 1
            outs.append(self.script[k][turn][: params.max_new_tokens])
            trunc.append((k, turn) in self.truncate)
        self.calls.append(([list(p) for p in prompts], outs))
        pid, pm = left_pad(prompts, 0)
        rid, rm = right_pad(outs, 0)
        lp = -(torch.arange(rid.numel(), dtype=torch.float32).view(rid.shape) + 1) / 100 * rm
        return Rollout(pid, pm, rid, rm, lp, torch.tensor(trunc, dtype=torch.bool), torch.arange(len(prompts)))

    def load_weights(self, named_tensors):
        pass
