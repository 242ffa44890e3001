"""OpenRLHF's reward files read the query (the prompt the policy read, then its response) and the prompt: the reward
stage and the held-out evaluation pass each row's prompt text to a function that reads it, and verl's four-argument
functions are called as before."""

from __future__ import annotations

import torch

from alignrl.data.records import Rollout, Sample
from alignrl.rewards.registry import load_reward_fn, make_reward
from alignrl.rl.evaluate import heldout_eval
from alignrl.rl.scoring import RewardStage

QUESTION = "Q: What is 2+3? A:"
REWARD_FILE = """import torch

def reward_func(queries, prompts, labels):
    assert len(queries) == len(prompts) == len(labels) == 1
    assert prompts[0] == {question!r}, prompts  # the padding is not part of the prompt
    assert queries[0].startswith(prompts[0]), queries
    answer = queries[0][len(prompts[0]):].strip()
    return {{"rewards": torch.tensor([float(answer == labels[0])]), "scores": torch.zeros(1), "extra_logs": {{}}}}
"""


def rollout(tok, answers: list[str]) -> Rollout:
    """Each answer after the question, the prompts left-padded by two pad tokens as an engine pads them."""
    q = tok(QUESTION, add_special_tokens=False)["input_ids"]
    pad = tok.pad_token_id
    prompt_ids = torch.tensor([[pad, pad] + q] * len(answers))
    prompt_mask = prompt_ids != pad
    prompt_mask[:, :2] = False
    rows = [tok(a, add_special_tokens=False)["input_ids"] for a in answers]
    width = max(map(len, rows))
    response_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    response_mask = torch.tensor([[i < len(r) for i in range(width)] for r in rows])
    return Rollout(prompt_ids, prompt_mask, response_ids, response_mask, torch.zeros(response_ids.shape),
                   torch.zeros(len(answers), dtype=torch.bool), torch.arange(len(answers)))


def test_the_reward_stage_and_the_evaluation_pass_the_prompt_to_an_openrlhf_reward_file(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    path = tmp_path / "reward_func.py"
    path.write_text(REWARD_FILE.format(question=QUESTION))
    spec = f"openrlhf:{path}"
    samples = [Sample([{"role": "user", "content": "What is 2+3?"}], "5", "arith")] * 2
    stage = RewardStage(tok, make_reward(spec), load_reward_fn(spec), max_new_tokens=8)
    scores = stage.score(rollout(tok, [" 5", " 6"]), samples)
    assert scores.rewards.tolist() == [1.0, 0.0] and scores.correct.tolist() == [True, False]

    class Engine:  # the held-out evaluation's engine: the same two answers, one per problem
        def generate(self, prompts, params):
            return rollout(tok, [" 5", " 6"][:len(prompts)])

    accuracy = heldout_eval(Engine(), tok, samples, [[0], [0]], load_reward_fn(spec), max_new_tokens=8)
    assert accuracy["accuracy"] == 0.5, accuracy


def test_a_verl_function_still_gets_four_arguments():
    def compute_score(data_source, solution_str, ground_truth, extra_info):
        return float(solution_str.strip() == ground_truth)

    from alignrl.rewards.registry import checked, score_row

    fn = checked(compute_score, "f.py:compute_score")
    assert score_row(fn, "arith", " 5", "5", {}, "ignored prompt") == 1.0
    assert fn("arith", " 6", "5", {}) == 0.0
