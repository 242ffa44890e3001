"""Held-out pass@1 / pass@k by difficulty, on a scripted engine with hand-worked answers."""

from types import SimpleNamespace

import torch

from alignrl.rl.evaluate import format_room, heldout_eval, room
from alignrl.data.records import Sample
from alignrl.rewards.registry import load_reward_fn


class ScriptedEngine:
    """Answers from a table: greedy -> GREEDY[prompt], sampled -> SAMPLED[prompt][j]. A row's text is
    carried as its index into TEXTS in the first response token."""

    def __init__(self, greedy, sampled):
        self.greedy, self.sampled = greedy, sampled

    def generate(self, prompts, params):
        rows = [self.greedy[p[0]] if params.temperature == 0 else self.sampled[p[0]][j]
                for p in prompts for j in range(params.n)]
        ids = torch.tensor([[TEXTS.index(t) + 1] for t in rows])
        # a single-turn rollout carries no stats, and adds nothing to the rows' extra_info
        return SimpleNamespace(response_ids=ids, response_mask=torch.ones_like(ids, dtype=torch.bool),
                               stats={}, reward_extras=None)


TEXTS = ["2+3=5\n#### 5", "2+3=5\nThe answer is 5.", "2+3=6\n#### 6", "4*2=8\n8+1=9\n#### 9", "#### 1"]
TOKENIZER = SimpleNamespace(pad_token_id=0, batch_decode=lambda ids, **_: [TEXTS[int(r[0]) - 1] for r in ids])


def _sample(answer: str, ops: int) -> Sample:
    return Sample(messages=[{"role": "user", "content": "q"}], ground_truth=answer, data_source="synthetic_arith",
                  extra={"ops": ops})


def test_room_counts_any_of_k_and_splits_by_difficulty():
    samples = [_sample("5", 1), _sample("5", 1), _sample("9", 2)]
    greedy = {0: TEXTS[0], 1: TEXTS[1], 2: TEXTS[4]}  # strict right, right in plain text, wrong
    sampled = {0: [TEXTS[2], TEXTS[0]], 1: [TEXTS[2], TEXTS[2]], 2: [TEXTS[4], TEXTS[3]]}
    r = room(ScriptedEngine(greedy, sampled), TOKENIZER, samples, [[0], [1], [2]], load_reward_fn(None),
             max_new_tokens=8, k=2, temperature=1.0)
    assert r["pass@1"]["strict"] == {"all": round(1 / 3, 4), "ops=1": 0.5, "ops=2": 0.0}
    assert r["pass@1"]["flexible"] == {"all": round(2 / 3, 4), "ops=1": 1.0, "ops=2": 0.0}
    assert r["pass@k"]["strict"] == {"all": round(2 / 3, 4), "ops=1": 0.5, "ops=2": 1.0}
    assert r["pass@k"]["flexible"] == r["pass@k"]["strict"]
    assert "ops=2 0.000/1.000" in format_room(r)
    # heldout_eval agrees with room's pass@1
    acc = heldout_eval(ScriptedEngine(greedy, sampled), TOKENIZER, samples, [[0], [1], [2]], load_reward_fn(None), 8)
    assert acc == {"accuracy": 1 / 3, "accuracy_flexible": 2 / 3}


def test_a_task_not_scored_by_last_number_reports_no_last_number_accuracy():
    """A math-verify task (data_source `math`): the GSM8K last-number reading is left out everywhere
    instead of showing a column of zeros beside the task's own accuracy."""
    samples = [Sample(messages=[{"role": "user", "content": "q"}], ground_truth=g, data_source="math")
               for g in ("5", "9")]
    greedy, sampled = {0: TEXTS[0], 1: TEXTS[3]}, {0: [TEXTS[0]], 1: [TEXTS[4]]}
    engine = ScriptedEngine(greedy, sampled)
    assert heldout_eval(engine, TOKENIZER, samples, [[0], [1]], load_reward_fn(None), 8) == {"accuracy": 1.0}
    r = room(engine, TOKENIZER, samples, [[0], [1]], load_reward_fn(None), max_new_tokens=8, k=1, temperature=1.0)
    assert list(r["pass@1"]) == ["strict"] and "flexible" not in format_room(r)


def test_evaluation_samples_as_the_rollouts_do():
    """The held-out decoding stops at the rollouts' stop strings, and pass@k samples with their top_p/top_k/min_p
    and repetition penalty: the evaluation ran on to max_new_tokens and scored text the policy never produces in
    training."""
    from alignrl.rl.evaluate import validation_params

    seen = []

    class Recording(ScriptedEngine):
        def generate(self, prompts, params):
            seen.append(params)
            return super().generate(prompts, params)

    samples = [_sample("5", 1)]
    engine = Recording({0: TEXTS[0]}, {0: [TEXTS[0], TEXTS[2]]})
    heldout_eval(engine, TOKENIZER, samples, [[0]], load_reward_fn(None), 8, stop=["\n\n"])
    room(engine, TOKENIZER, samples, [[0]], load_reward_fn(None), max_new_tokens=8, k=2, temperature=0.7,
         stop=["\n\n"], top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.2)
    assert [p.stop for p in seen] == [("\n\n",)] * 3
    assert (seen[2].top_p, seen[2].top_k, seen[2].temperature, seen[2].min_p) == (0.9, 5, 0.7, 0.1)
    assert [p.repetition_penalty for p in seen] == [1.0, 1.2, 1.2]  # greedy pass@1 decodes under the penalty too
    greedy = validation_params(8, repetition_penalty=1.2, min_p=0.1)
    assert (greedy.temperature, greedy.repetition_penalty, greedy.min_p) == (0.0, 1.2, 0.0)
    sampled = validation_params(8, temperature=0.5, min_p=0.1, repetition_penalty=1.2)
    assert (sampled.min_p, sampled.repetition_penalty) == (0.1, 1.2)


def test_sampled_validation_is_the_mean_of_the_answers_with_pass_at_n_beside_it():
    """verl's val_kwargs with do_sample: n answers a problem at a temperature; accuracy is their mean (mean@n)."""
    from alignrl.rl.evaluate import validation_params

    samples = [_sample("5", 1), _sample("5", 1), _sample("9", 2)]
    greedy = {0: TEXTS[4], 1: TEXTS[4], 2: TEXTS[4]}  # greedy gets all wrong: the sampler must be the one used
    sampled = {0: [TEXTS[2], TEXTS[0]], 1: [TEXTS[2], TEXTS[2]], 2: [TEXTS[3], TEXTS[3]]}
    params = validation_params(8, temperature=0.6, top_p=0.9, n=2, seed=3)
    assert (params.n, params.temperature, params.top_p, params.seed) == (2, 0.6, 0.9, 3)
    full, small = heldout_eval(ScriptedEngine(greedy, sampled), TOKENIZER, samples, [[0], [1], [2]],
                               load_reward_fn(None), 8, subset=2, params=params)
    assert full == {"accuracy": 3 / 6, "accuracy_flexible": 3 / 6, "pass@2": 2 / 3}
    assert small == {"accuracy": 1 / 4, "accuracy_flexible": 1 / 4, "pass@2": 1 / 2}
    assert validation_params(8, temperature=0.0, n=4).n == 1  # temperature 0: greedy, one answer
