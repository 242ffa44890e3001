"""Episodes against a user's environment in OpenRLHF's agent format (agent.env_path, --agent_func_path): the file
runs without OpenRLHF, each turn's ids are kept as generated with the feedback between them, the environment's
rewards and scores become the run's, and a broken file or environment is one line."""

import json
import textwrap

import pytest
import torch

from alignrl.data.records import Sample
from alignrl.interfaces import SamplingParams
from alignrl.rollout.env_agent import EnvironmentStepError, EnvRollout, TaskPrompt, with_labels
from alignrl.rollout.environments import EnvironmentFileError, load_environment
from conftest import one_line
from scripted_engine import ScriptedEngine

pytestmark = pytest.mark.timeout(240)

# OpenRLHF's example shape: the answer is checked against the label, a wrong one gets feedback and another turn
GUESS_ENV = '''
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

SEEN = []


class AgentInstance(AgentInstanceBase):
    async def __init__(self, *args, **kwargs):  # async, as OpenRLHF's older examples write it
        self.step_idx = 0

    async def reset(self, states: dict, **kwargs):
        SEEN.append(("reset", states["observation"], states["label"]))
        SEEN.append(("row", states["sample"].messages[-1]["content"]))  # alignrl's extra key: the dataset row
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        SEEN.append(("step", states["action_text"], states["label"]))
        self.step_idx += 1
        right = states["label"] in states["action_text"]
        done = right or self.step_idx >= 3
        reward = torch.tensor(1.0 if right else -0.25)
        return {"rewards": reward, "scores": torch.tensor(float(right)),
                "environment_feedback": "" if done else " wrong, again:",
                "done": done, "sampling_params": states.get("sampling_params"),
                "extra_logs": {"tries": torch.tensor(float(self.step_idx))}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


def _env_file(tmp_path, text=GUESS_ENV, name="agent_func.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _labeled(tok, texts_labels):
    return [TaskPrompt(_enc(tok, t), Sample([{"role": "user", "content": t}], label)) for t, label in texts_labels]


def test_turns_keep_generated_ids_feedback_between_and_env_rewards(tiny_model, tmp_path):
    _, tok = tiny_model
    make = load_environment(_env_file(tmp_path))
    prompts = _labeled(tok, [("one plus one", "2"), ("two plus two", "4")])
    wrong, right2, right4 = _enc(tok, " 7"), _enc(tok, " 2"), _enc(tok, " 4")
    engine = ScriptedEngine({prompts[0][0]: [wrong, right2], prompts[1][0]: [right4]})
    ro = EnvRollout(engine, tok, make, response_cap=64).generate(prompts, SamplingParams(max_new_tokens=8))
    feedback = _enc(tok, " wrong, again:")
    first = ro.response_ids[0][ro.response_mask[0]].tolist()
    assert first == wrong + feedback + right2  # token in, token out: the turns' ids exactly, feedback between
    assert ro.loss_mask[0][ro.response_mask[0]].tolist() == [True] * len(wrong) + [False] * len(feedback) + \
        [True] * len(right2)
    assert (ro.logprobs[0][len(wrong):len(wrong) + len(feedback)] == 0).all()
    assert (ro.logprobs[0][:len(wrong)] < 0).all()
    assert ro.response_ids[1][ro.response_mask[1]].tolist() == right4
    assert engine.calls[1][0] == [prompts[0] + wrong + feedback]  # the second turn reads the first and its feedback
    assert ro.stats["env_reward"].tolist() == [0.75, 1.0] and ro.stats["env_score"].tolist() == [1.0, 1.0]
    assert ro.stats["turns"].tolist() == [2.0, 1.0] and ro.stats["env/tries"].tolist() == [2.0, 1.0]
    assert not ro.truncated.any()
    seen = load_environment.__globals__["sys"].modules  # the file's module, to read what the environment was given
    module = next(m for n, m in seen.items() if n.startswith("alignrl_environment_") and hasattr(m, "SEEN"))
    assert ("reset", "one plus one", "2") in module.SEEN and ("step", " 7", "2") in module.SEEN
    assert ("row", "two plus two") in module.SEEN


def test_feedback_returned_with_done_is_appended_as_context_cut_to_the_room_left(tiny_model, tmp_path):
    _, tok = tiny_model
    env = _env_file(tmp_path, GUESS_ENV.replace('"" if done else " wrong, again:"',
                                                '" right, well done!" if right else " wrong, again:"'))
    prompts = _labeled(tok, [("q", "5")])
    right, praise = _enc(tok, " 5"), _enc(tok, " right, well done!")
    ro = EnvRollout(ScriptedEngine({prompts[0][0]: [right]}), tok, load_environment(env), 64).generate(
        prompts, SamplingParams())
    assert ro.response_ids[0][ro.response_mask[0]].tolist() == right + praise  # as OpenRLHF appends it
    assert ro.loss_mask[0][ro.response_mask[0]].tolist() == [True] * len(right) + [False] * len(praise)
    assert (ro.logprobs[0][len(right):len(right) + len(praise)] == 0).all() and not ro.truncated.any()
    cut = EnvRollout(ScriptedEngine({prompts[0][0]: [right]}), tok, load_environment(env), len(right) + 2).generate(
        prompts, SamplingParams())
    # cut to the room left; the answer itself ended, so the episode is not truncated
    assert cut.response_ids[0].tolist() == right + praise[:2] and cut.truncated.tolist() == [False]


def test_n_samples_per_prompt_each_get_their_own_environment(tiny_model, tmp_path):
    _, tok = tiny_model
    prompts = _labeled(tok, [("q", "5")])
    engine = ScriptedEngine({prompts[0][0]: [_enc(tok, " 1"), _enc(tok, " 5"), _enc(tok, " 3"), _enc(tok, " 9")]})
    ro = EnvRollout(engine, tok, load_environment(_env_file(tmp_path)), 64).generate(prompts, SamplingParams(n=2))
    # two episodes of one prompt: turn 1 gives " 1" and " 5" (the second is right at once), turn 2 gives " 3" to the
    # first; each environment counted its own steps
    assert ro.group.tolist() == [0, 0] and ro.stats["turns"].tolist() == [3.0, 1.0]
    assert ro.stats["env_score"].tolist() == [0.0, 1.0]


def test_reset_observation_becomes_the_prompt_and_caps_cut_the_episode(tiny_model, tmp_path):
    _, tok = tiny_model
    env = GUESS_ENV.replace('return {"observation": states["observation"]}',
                            'return {"observation": "System: answer. " + states["observation"]}')
    prompts = _labeled(tok, [("q", "5")])
    long_wrong = _enc(tok, " 1 1 1 1 1 1")
    engine = ScriptedEngine({_enc(tok, "System: answer. q")[0]: [long_wrong, long_wrong]}, truncate={})
    cap = len(long_wrong) + 2  # the feedback does not fit after the first turn
    ro = EnvRollout(engine, tok, load_environment(_env_file(tmp_path, env)), cap).generate(prompts, SamplingParams())
    assert ro.prompt_ids[0][ro.prompt_mask[0]].tolist() == _enc(tok, "System: answer. q")
    assert ro.truncated.tolist() == [True] and ro.stats["turns"].tolist() == [1.0]
    assert ro.response_ids[0][ro.response_mask[0]].tolist() == long_wrong


def test_max_turns_bounds_the_episode(tiny_model, tmp_path):
    _, tok = tiny_model
    prompts = _labeled(tok, [("q", "5")])
    engine = ScriptedEngine({prompts[0][0]: [_enc(tok, " 1")] * 3})
    ro = EnvRollout(engine, tok, load_environment(_env_file(tmp_path)), 64, max_turns=2).generate(
        prompts, SamplingParams())
    assert ro.stats["turns"].tolist() == [2.0] and ro.stats["env_reward"].tolist() == [-0.5]


def test_reward_stage_and_evaluation_take_the_environment_s_scores(tiny_model, tmp_path):
    from alignrl.rl.evaluate import _scores
    from alignrl.rl.scoring import RewardStage

    _, tok = tiny_model
    samples = [Sample([{"role": "user", "content": "q"}], "5"), Sample([{"role": "user", "content": "r"}], "6")]
    prompts = [_enc(tok, "q"), _enc(tok, "r")]
    engine = EnvRollout(ScriptedEngine({prompts[0][0]: [_enc(tok, " 5")], prompts[1][0]: [_enc(tok, " 0")] * 3}),
                        tok, load_environment(_env_file(tmp_path)), 64)
    labeled = with_labels(engine, samples, prompts)
    assert [p.label for p in labeled] == ["5", "6"] and with_labels(object(), samples, prompts) is prompts

    def never(*a, **k):  # the environment scores: a rule function is never asked
        raise AssertionError("rule reward called")

    stage = RewardStage(tok, never, never, 64)
    scores = stage.score(engine.generate(labeled, SamplingParams()), samples)
    assert scores.rewards.tolist() == [1.0, -0.75] and scores.correct.tolist() == [True, False]
    assert scores.for_filtering.tolist() == [1.0, 0.0]  # dynamic filtering tests the scores, as OpenRLHF's does
    assert scores.rows(torch.tensor([1])).cat(scores).for_filtering.tolist() == [0.0, 1.0, 0.0]
    engine.engine.seen.clear()
    strict, _ = _scores(engine, tok, samples, prompts, never, SamplingParams(), batch_size=2)
    assert strict.flatten().tolist() == [1.0, 0.0]


def test_an_environment_without_rewards_leaves_scoring_to_the_reward_function(tiny_model, tmp_path):
    from alignrl.rl.scoring import RewardStage

    _, tok = tiny_model
    make = load_environment(_env_file(tmp_path, GUESS_ENV.replace('"rewards": reward, ', "")))
    make.gives_rewards = False  # a tool environment: its feedback shapes the episode, the reward function scores it
    prompts = _labeled(tok, [("q", "5")])
    ro = EnvRollout(ScriptedEngine({prompts[0][0]: [_enc(tok, " 1"), _enc(tok, " 5")]}), tok, make, 64).generate(
        prompts, SamplingParams())
    assert "env_reward" not in ro.stats and ro.stats["turns"].tolist() == [2.0]
    texts = []
    stage = RewardStage(tok, lambda ds, text, gt, extra=None: texts.append(text) or float(gt in text), None, 64)
    stage.correct_fn = stage.reward_fn
    assert stage.score(ro, [prompts[0].sample]).rewards.tolist() == [1.0]
    assert texts == [" 1 wrong, again: 5"]  # the whole response, feedback included, as verl's reward reads it


def test_an_environment_whose_constructor_raises_is_one_line(tiny_model, tmp_path):
    _, tok = tiny_model
    env = GUESS_ENV.replace("        self.step_idx = 0\n", "        raise RuntimeError('no sandbox')\n", 1)
    prompts = _labeled(tok, [("q", "5")])
    with pytest.raises(EnvironmentStepError) as err:
        EnvRollout(ScriptedEngine({}), tok, load_environment(_env_file(tmp_path, env)), 64).generate(
            prompts, SamplingParams())
    assert "AgentInstance.__init__ raised RuntimeError: no sandbox" in one_line(str(err.value))


@pytest.mark.parametrize("change, expect", [
    ('raise ValueError("no answer key")', "AgentInstance.step raised ValueError: no answer key"),
    ("return {'done': True}", "AgentInstance.step returned dict without 'rewards'"),
    ("return {'rewards': float('nan'), 'done': True}", "AgentInstance.step returned rewards=nan"),
    ("return {'rewards': 1.0, 'done': True, 'environment_feedback': 3}", "a int 'environment_feedback'"),
])
def test_a_broken_step_is_one_line(tiny_model, tmp_path, change, expect):
    _, tok = tiny_model
    env = GUESS_ENV.replace('        SEEN.append(("step", states["action_text"], states["label"]))',
                            f"        {change}")
    prompts = _labeled(tok, [("q", "5")])
    engine = ScriptedEngine({prompts[0][0]: [_enc(tok, " 1")]})
    with pytest.raises(EnvironmentStepError) as err:
        EnvRollout(engine, tok, load_environment(_env_file(tmp_path, env)), 64).generate(prompts, SamplingParams())
    assert expect in one_line(str(err.value))


@pytest.mark.parametrize("text, expect", [
    (None, "no such file"),
    ("import openrlhf.trainer.ppo_utils\n", "failed to import: ModuleNotFoundError"),
    ("x = 1 / 0\n", "failed to import: ZeroDivisionError"),
    ("class Env:\n    pass\n", "found 0 AgentInstanceBase subclasses"),
    (GUESS_ENV.replace("    async def step", "    def step"), "step must be a coroutine"),
    (GUESS_ENV + "\n\nclass AgentExecutor(MultiTurnAgentExecutor):\n    async def execute(self, *a):\n        pass\n",
     "overrides execute()"),
])
def test_a_bad_environment_file_is_one_line(tmp_path, text, expect):
    path = _env_file(tmp_path, text) if text is not None else str(tmp_path / "missing.py")
    with pytest.raises(EnvironmentFileError) as err:
        load_environment(path)
    assert expect in one_line(str(err.value)) and "agent.env_path" in str(err.value)


def test_image_prompts_keep_their_images_beside_their_labels(tiny_model, tmp_path):
    """An environment reads the prompt as text; the images stay with the prompt for the engine and the trainer."""
    from alignrl.data.images import ImagePrompt

    _, tok = tiny_model
    engine = EnvRollout(ScriptedEngine({}), tok, load_environment(_env_file(tmp_path)), 64)
    pictures = object()
    (task,) = with_labels(engine, [Sample([], "1")], [ImagePrompt([1, 2], pictures, ("p",))])
    assert list(task) == [1, 2] and task.label == "1" and task.images is pictures and task.pictures == ("p",)


def test_config_checks_name_the_keys_that_do_not_go_with_an_environment(tmp_path):
    from alignrl.config import ConfigError, load_config

    path = _env_file(tmp_path)
    with pytest.raises(ConfigError, match="drop algorithm.reward_model"):
        load_config(None, [f"agent.env_path={path}", f"algorithm.reward_model={tmp_path}"])
    with pytest.raises(ConfigError, match="recompute_old_logprobs=true"):
        load_config(None, [f"agent.env_path={path}", "actor.state_masking=false",
                                 "actor.recompute_old_logprobs=false"])
    with pytest.raises(ConfigError, match="what the turns append"):  # Search-R1's search agent alike
        load_config(None, ["agent.max_turns=2", "actor.state_masking=false", "actor.recompute_old_logprobs=false"])
    cfg = load_config(None, [f"agent.env_path={path}", "rollout.max_new_tokens=24"])
    from alignrl.config.checks import response_cap

    assert response_cap(cfg) == 24
    assert response_cap(load_config(None, [f"agent.env_path={path}", "agent.max_response_length=40"])) == 40


def test_grpo_trains_against_the_environment(tiny_model_dir, tmp_path, cli_in_process):
    """Two GRPO steps of the tiny model whose rewards come from the environment file: the run's metrics carry its
    turns, rewards and extra logs, and the held-out evaluation reads its scores."""
    from conftest import SMALL_GRPO, run_settings

    path = _env_file(tmp_path)
    got = cli_in_process("train", "grpo", *SMALL_GRPO, f"model.path={tiny_model_dir}",
                         *run_settings(tmp_path / "out", "env", 2), f"agent.env_path={path}", "agent.max_turns=2",
                         "agent.max_response_length=40")
    assert got.returncode == 0, got.stderr[-3000:] + got.stdout[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "env" / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "agent/turns" in r]
    # a turn of 6 tokens, the feedback and a second turn fit in 40: a wrong first answer gets its second turn
    assert len(steps) == 2 and all(1.0 <= r["agent/turns"] <= 2.0 and r["agent/tries"] == r["agent/turns"]
                                   for r in steps)
    assert all(r["agent/generated_token_frac"] < 1.0 for r in steps if r["agent/turns"] > 1.0)
    assert any(r["agent/turns"] > 1.0 for r in steps)
    assert [r["val/accuracy"] for r in rows if "val/accuracy" in r]  # the base model, scored by the environment


def test_the_example_environment_gives_half_the_reward_after_its_hint(tiny_model):
    from pathlib import Path

    import alignrl

    _, tok = tiny_model
    path = Path(alignrl.__file__).parent / "examples" / "envs" / "retry_arithmetic.py"
    prompts = _labeled(tok, [("a", "12"), ("b", "7"), ("c", "3")])
    engine = ScriptedEngine({prompts[0][0]: [_enc(tok, " so #### 12")],
                             prompts[1][0]: [_enc(tok, " #### 8"), _enc(tok, " #### 7")],
                             prompts[2][0]: [_enc(tok, " no idea"), _enc(tok, " #### 4")]})
    ro = EnvRollout(engine, tok, load_environment(str(path)), 96).generate(prompts, SamplingParams())
    assert ro.stats["env_reward"].tolist() == [1.0, 0.5, 0.0] and ro.stats["env_score"].tolist() == [1.0, 0.0, 0.0]
    assert ro.stats["env/solved_after_hint"].tolist() == [0.0, 1.0, 0.0] and ro.stats["turns"].tolist() == [1, 2, 2]
    hint = _enc(tok, "\nThat is not right. Check each step, then give the answer again as #### N.\n")
    assert ro.response_ids[1][ro.response_mask[1]].tolist() == _enc(tok, " #### 8") + hint + _enc(tok, " #### 7")
