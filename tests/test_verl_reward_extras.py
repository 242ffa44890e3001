"""verl's tool loop hands the reward function each episode's turn_scores (its interaction's scores), tool_rewards (its
tools' step rewards) and num_turns in extra_info, as verl's reward manager merges its agent loop's extra_fields: in
training's reward stage and in held-out scoring; other rollouts' rows reach the reward function unchanged."""

import copy
import sys

import pytest
import torch

from alignrl.data.collate import prompt_ids
from alignrl.data.records import Rollout, Sample
from alignrl.interfaces import SamplingParams
from alignrl.rl.evaluate import heldout_eval
from alignrl.rl.rollout_ops import concat_rollouts, select_groups
from alignrl.rl.scoring import RewardStage, with_reward_extras
from alignrl.rollout.env_agent import EnvRollout, TaskPrompt
from alignrl.rollout.verl_tools import ToolLoop, ToolResultError, tool_environment
from conftest import one_line
from scripted_engine import ScriptedEngine
from test_verl_interactions import GSM8K_YAML as INTERACTIONS

pytestmark = pytest.mark.timeout(120)

# a user's tool whose step reward is its answer / 10: "none" gives no reward, "boom" raises (verl's 0.0), "high" is
# not a number; "3" answers last, so call order and completion order differ
SCORE_TOOL = '''
import asyncio
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse


class ScoreTool(BaseTool):
    async def create(self, instance_id=None, **kwargs):
        return instance_id or str(uuid4()), ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        answer = parameters["answer"]
        if answer == "boom":
            raise RuntimeError("boom")
        if answer == "3":
            await asyncio.sleep(0.05)
        reward = None if answer == "none" else "high" if answer == "high" else float(answer) / 10
        return ToolResponse(text="ok " + answer), reward, {}
'''
TOOLS = """tools:
  - class_name: "{module}.ScoreTool"
    config: {{type: native}}
    tool_schema:
      type: function
      function:
        name: score
        description: scores an answer
        parameters: {{type: object, properties: {{answer: {{type: string}}}}, required: [answer]}}
"""


@pytest.fixture
def configs(tmp_path, monkeypatch):
    """(tool config, interaction config) paths: the user's ScoreTool (a module of the working folder, named per test)
    and verl's gsm8k interaction."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    monkeypatch.chdir(tmp_path)
    module = f"score_tool_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{module}.py").write_text(SCORE_TOOL)
    (tmp_path / "tools.yaml").write_text(TOOLS.format(module=module))
    (tmp_path / "interaction.yaml").write_text(INTERACTIONS)
    return str(tmp_path / "tools.yaml"), str(tmp_path / "interaction.yaml")


def _calls(*answers):
    return "".join(f'<tool_call>{{"name": "score", "arguments": {{"answer": "{a}"}}}}</tool_call>' for a in answers)


def _episodes(tok, configs):
    """Row 0 plays tools and verl's gsm8k interaction: two turns of two calls each, a wrong answer (turn score 0.0)
    and a right one (1.0, which ends it); row 1 has no interaction and answers at once."""
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    rows = [Sample([{"role": "user", "content": "6 * 12?"}], "72", "openai/gsm8k",
                   extra={"interaction_kwargs": {"name": "gsm8k", "ground_truth": "72"}, "index": 0}),
            Sample([{"role": "user", "content": "6 * 2?"}], "12", "openai/gsm8k", extra={"index": 1})]
    prompts = [prompt_ids(tok, r) for r in rows]
    turns = [[enc(_calls("3", "boom")), enc(_calls("none", "5")), enc(" so #### 7"), enc(" so #### 72")],
             [enc(" so #### 12")]]
    script = {tuple(p): t for p, t in zip(prompts, turns)}
    engine = ScriptedEngine(script, key=lambda ids: next(k for k in script if tuple(ids[:len(k)]) == k))
    env = EnvRollout(engine, tok, tool_environment(configs[0], tok, ToolLoop(max_parallel_calls=2), configs[1]),
                     response_cap=900)
    return rows, prompts, env


# what each episode adds to extra_info: row 0's num_turns counts 4 assistant, 2 tool and 2 interaction turns and the
# prompt; "boom" failed (0.0), "none" gave no reward; row 1 has empty lists, as verl gives them
PLAYED = [{"turn_scores": [0.0, 1.0], "tool_rewards": [0.3, 0.0, 0.5], "num_turns": 9},
          {"turn_scores": [], "tool_rewards": [], "num_turns": 2}]


def test_the_reward_function_reads_the_interactions_and_the_tools_scores(tiny_model, configs):
    _, tok = tiny_model
    rows, prompts, env = _episodes(tok, configs)
    ro = env.generate([TaskPrompt(p, r) for p, r in zip(prompts, rows)], SamplingParams(max_new_tokens=200))
    assert ro.reward_extras == PLAYED
    assert ro.stats["env/verl_num_turns"].tolist() == [9.0, 2.0] and ro.stats["env/tool_errors"].tolist() == [1, 0]
    seen = []

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        seen.append(copy.deepcopy(extra_info))
        return extra_info["turn_scores"][-1] if extra_info["turn_scores"] else sum(extra_info["tool_rewards"])

    def correct(data_source, solution_str, ground_truth, extra_info):
        extra_info["turn_scores"].append(9.0)  # a function that edits extra_info leaves the rollout's record intact
        return compute_score(data_source, solution_str, ground_truth, extra_info) + 1.0

    stage = RewardStage(tok, compute_score, correct, 900)
    scores = stage.score(ro, rows)
    assert scores.rewards.tolist() == [1.0, 0.0] and scores.correct.tolist() == [True, True]
    # the row's own keys, then verl's, for the reward and then for correctness
    assert seen[:2] == [{**r.extra, **x} for r, x in zip(rows, PLAYED)] and seen[2]["turn_scores"] == [0.0, 1.0, 9.0]
    assert ro.reward_extras == PLAYED
    assert rows[0].extra == {"interaction_kwargs": {"name": "gsm8k", "ground_truth": "72"}, "index": 0}


def test_held_out_scoring_reads_them_too(tiny_model, configs):
    _, tok = tiny_model
    rows, prompts, env = _episodes(tok, configs)
    seen = []

    def correct(data_source, solution_str, ground_truth, extra_info):
        seen.append((extra_info["turn_scores"], extra_info["tool_rewards"], extra_info["num_turns"]))
        return float(extra_info["turn_scores"][-1:] == [1.0])

    assert heldout_eval(env, tok, rows, prompts, correct, 200)["accuracy"] == 0.5
    assert seen == [(x["turn_scores"], x["tool_rewards"], x["num_turns"]) for x in PLAYED]


def test_a_step_reward_that_is_not_a_number_is_one_line(tiny_model, configs):
    _, tok = tiny_model
    rows, prompts, env = _episodes(tok, configs)
    env.engine.script[tuple(prompts[0])][0] = tok.encode(_calls("high"), add_special_tokens=False)
    with pytest.raises(ToolResultError) as err:
        env.generate([TaskPrompt(prompts[0], rows[0])], SamplingParams(max_new_tokens=200))
    assert "tool 'score' returned the step reward 'high'; return a finite number (or None)" in one_line(str(err.value))


class _Done:
    """An OpenRLHF environment: one step, rewarded, done."""

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        return {"rewards": 1.0, "scores": 1.0, "environment_feedback": "", "done": True}


def test_other_rollouts_keep_their_rows_and_row_operations_keep_the_extras(tiny_model):
    _, tok = tiny_model
    rows = [Sample([{"role": "user", "content": "q"}], "1", extra={"index": 0})]
    prompts = [prompt_ids(tok, rows[0])]

    async def make():
        return _Done()

    engine = ScriptedEngine({tuple(prompts[0]): [tok.encode(" 1", add_special_tokens=False)]},
                            key=lambda ids: tuple(prompts[0]))
    ro = EnvRollout(engine, tok, make, response_cap=50).generate([TaskPrompt(prompts[0], rows[0])],
                                                                 SamplingParams(max_new_tokens=10))
    assert ro.reward_extras is None and with_reward_extras(ro, rows) is rows

    def rollout(extras):
        b = 2 if extras is None else len(extras)
        ids = torch.ones(b, 2, dtype=torch.long)
        return Rollout(ids, ids.bool(), ids, ids.bool(), torch.zeros(b, 2), torch.zeros(b, dtype=torch.bool),
                       torch.arange(b), reward_extras=extras)

    played = rollout([{"turn_scores": [float(i)]} for i in range(3)])
    assert select_groups(played, [0, 2]).reward_extras == [{"turn_scores": [0.0]}, {"turn_scores": [2.0]}]
    # joined with rows that have none (a single-turn engine's), those rows add nothing
    assert concat_rollouts(rollout(None), played, 0).reward_extras == [{}, {}] + played.reward_extras
    assert concat_rollouts(rollout(None), rollout(None), 0).reward_extras is None
