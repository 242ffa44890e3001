"""SPIN's rollouts (Chen et al. 2024, "Self-Play Fine-Tuning Converts Weak Language Models to Strong Language Models"):
each prompt's first answer is its dataset row's target response (the ground truth, as text), the second the
opponent's, sampled by the reference (the previous iterate when actor.ref_sync_steps copies the policy into it).

The target is tokenized as the policy would have generated it after its prompt: the chat template renders the
conversation with the target as the assistant's turn, and the tokens past the prompt up to the first stop token are
the answer (the turn's own end token, <|im_end|> for ChatML, where the tokenizer's eos may be another). A raw prompt
(data.apply_chat_template=false) is tokenized with its target as one text. When that rendering does not begin with
the prompt's own tokens (a template that rewrites earlier turns, a prompt cut to its length limit), the target is
tokenized alone and ended by the tokenizer's end-of-sequence token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch

from alignrl.data.records import Rollout
from alignrl.errors import DataError
from alignrl.interfaces import SamplingParams, derived_seed
from alignrl.rl.rollout_ops import interleave_pairs


class TargetPairEngine:
    """A RolloutEngine of two answers per prompt: its row's target, then `reference`'s sample (an in-process engine
    with `pad_id` and `eos`, the stop tokens)."""

    reads_labels = True  # handed each prompt's dataset row (rollout.env_agent.TaskPrompt)

    def __init__(self, reference, tokenizer, eos_id: int):
        self.reference, self.tokenizer, self.eos_id = reference, tokenizer, eos_id
        self.stops = set(reference.eos.tolist())

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Rollout:
        if params.n != 2:
            raise ValueError(f"the target answer is paired with the reference's: rollout.n=2 (got {params.n})")
        theirs = self.reference.generate(prompts, replace(params, n=1, seed=derived_seed(params.seed, 1)))
        targets = [self.target(p, params.max_new_tokens) for p in prompts]
        width = max(len(ids) for ids, _ in targets)
        ids = torch.full((len(targets), width), self.reference.pad_id, dtype=torch.long)
        for row, (target, _) in enumerate(targets):
            ids[row, :len(target)] = torch.tensor(target, dtype=torch.long)
        lengths = torch.tensor([len(target) for target, _ in targets])
        mask = torch.arange(width)[None, :] < lengths[:, None]
        mine = replace(theirs, response_ids=ids, response_mask=mask, logprobs=torch.zeros(ids.shape),
                       truncated=torch.tensor([cut for _, cut in targets]), loss_mask=None, stats={},
                       reward_extras=None)
        return interleave_pairs(mine, theirs, self.reference.pad_id)

    def target(self, prompt, cap: int) -> tuple[list[int], bool]:
        """(the target's token ids after `prompt` within `cap`, whether it was cut)."""
        sample = getattr(prompt, "sample", None)
        truth = getattr(sample, "ground_truth", None)
        if not isinstance(truth, str) or not truth.strip():
            where = getattr(sample, "source", None) or "a row"
            raise DataError(f"algorithm.adv_estimator=spin trains toward each row's target response, its ground truth "
                            f"as text, and {where} holds {type(truth).__name__} {str(truth)[:40]!r}: set "
                            "data.label_key to the column of target responses")
        ids = self._after(list(prompt), sample, truth)
        return ids[:cap], len(ids) > cap

    def _after(self, prompt: list[int], sample, truth: str) -> list[int]:
        whole = self._rendered(sample, truth)
        if whole is not None and whole[:len(prompt)] == prompt and len(whole) > len(prompt):
            tail = whole[len(prompt):]
            end = next((i for i, t in enumerate(tail) if t in self.stops), None)
            return tail[:end + 1] if end is not None else tail + [self.eos_id]
        return list(self.tokenizer(truth, add_special_tokens=False)["input_ids"]) + [self.eos_id]

    def _rendered(self, sample, truth: str) -> list[int] | None:
        """The prompt and the target as one sequence of token ids, as the policy reads a conversation; None for a
        prompt with images (its processor renders it)."""
        if getattr(sample, "images", ()):
            return None
        text = getattr(sample, "prompt_text", None)
        if text is not None:
            return list(self.tokenizer(text + truth, add_special_tokens=False)["input_ids"])
        if not getattr(self.tokenizer, "chat_template", None):
            return None
        ids = self.tokenizer.apply_chat_template([*sample.messages, {"role": "assistant", "content": truth}],
                                                 add_generation_prompt=False, tokenize=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])  # transformers 5 returns a BatchEncoding

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing: neither answer is the policy's (a ZeroMQ sampler still hands each publish to its engine)."""
