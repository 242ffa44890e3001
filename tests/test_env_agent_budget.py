"""What an episode against a user's environment may spend (agent.env_path, OpenRLHF's --agent_func_path): the sampling
params its `step` reads and changes for the following turns (OpenRLHF's states["sampling_params"]), and OpenRLHF's
length budget, under which a short prompt lends its unused length to the response."""

import json

import pytest

from alignrl.data.records import Sample
from alignrl.interfaces import SamplingParams
from alignrl.rollout.env_agent import EnvironmentStepError, EnvRollout, TaskPrompt
from alignrl.rollout.environments import load_environment
from conftest import one_line
from test_env_agent import _enc, _labeled, _env_file as write_env
from scripted_engine import ScriptedEngine

pytestmark = pytest.mark.timeout(240)

# the label says what the first step does to the sampling params; the second step ends the episode
SAMPLING_ENV = '''
import types
from openrlhf.utils.agent import AgentInstanceBase

SAMPLING_SEEN = []


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.steps = 0

    async def step(self, states, **kwargs):
        self.steps += 1
        sp, how = states["sampling_params"], states["label"]
        SAMPLING_SEEN.append((how, self.steps, repr(sp), sp.max_tokens))
        out = {"rewards": 0.0, "environment_feedback": " again:", "done": self.steps >= 2}
        if self.steps > 1:
            return out
        if how == "same":  # OpenRLHF's examples hand the object back unchanged
            out["sampling_params"] = sp
        elif how == "hot":
            sp.temperature = 0.25
            out["sampling_params"] = sp
        elif how == "dict":
            out["sampling_params"] = {"top_k": 5, "max_tokens": 2, "stop": "!"}
        elif how == "inplace":  # changed where it lies, not returned: OpenRLHF reuses the object too
            sp.top_p = 0.5
        elif how == "vllm":  # another object with vLLM's attributes: alignrl's fields read, the others not
            out["sampling_params"] = types.SimpleNamespace(temperature=0.5, top_p=1.0, top_k=-1, max_tokens=None,
                                                           stop=None, seed=None, n=1, presence_penalty=0.3)
        else:
            exec(how)
        return out
'''


def _env_file(tmp_path, text=SAMPLING_ENV):
    return write_env(tmp_path, text)


def _module(name_part="SAMPLING_SEEN"):
    """The environment file's module last loaded (each test loads its own)."""
    import sys

    return [m for n, m in sys.modules.items() if n.startswith("alignrl_environment_") and hasattr(m, name_part)][-1]


def test_step_reads_the_turn_s_sampling_params_and_its_changes_sample_the_next_turns(tiny_model, tmp_path):
    _, tok = tiny_model
    labels = ["same", "hot", "dict", "inplace", "vllm", "same"]
    prompts = _labeled(tok, [(f"{w} q", how) for w, how in zip(["a", "b", "c", "d", "e", "f"], labels)])
    turn = _enc(tok, " 1 2 3 4 5 6")[:6]
    seen = []
    engine = ScriptedEngine({p[0]: [turn, turn] for p in prompts}, check=seen.append)
    run = SamplingParams(max_new_tokens=6, temperature=1.0, seed=7)
    ro = EnvRollout(engine, tok, load_environment(_env_file(tmp_path)), response_cap=64).generate(prompts, run)
    first = [row for row in _module().SAMPLING_SEEN if row[1] == 1]
    assert {r[2] for r in first} == {"SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, "
                                     "repetition_penalty=1.0, max_tokens=6, stop=[], seed=7, n=1)"}
    # turn 1: one call for all; turn 2: the unchanged episodes together, each changed one in its own call
    assert [len(c[0]) for c in engine.calls] == [6, 2, 1, 1, 1, 1]
    assert [c[0][0][0] for c in engine.calls[1:]] == [prompts[i][0] for i in (0, 1, 2, 3, 4)]
    assert engine.calls[1][0][1][0] == prompts[5][0]
    default, hot, by_dict, inplace, vllm = seen[1:]
    assert default == SamplingParams(max_new_tokens=6, temperature=1.0, seed=default.seed) and default.seed != 7
    assert hot == SamplingParams(max_new_tokens=6, temperature=0.25, seed=default.seed)
    assert by_dict == SamplingParams(max_new_tokens=2, top_k=5, stop=("!",), seed=default.seed)
    assert inplace == SamplingParams(max_new_tokens=6, top_p=0.5, seed=default.seed)
    # max_tokens None lifts the per-turn limit: the room left under the cap (64 - the turn and the feedback)
    room = 64 - len(turn) - len(_enc(tok, " again:"))
    assert vllm == SamplingParams(max_new_tokens=room, temperature=0.5, seed=None)  # its seed too: None
    again = len(_enc(tok, " again:"))  # after each step, the last (done) one's too
    assert ro.response_lengths.tolist()[2] == len(turn) + again + 2 + again  # max_tokens=2 cut its second turn
    second = {r[0]: r for r in _module().SAMPLING_SEEN if r[1] == 2}
    assert second["dict"][3] == 2 and "top_k=5" in second["dict"][2]  # the next step reads the params in force
    assert not ro.truncated.any()


def test_step_max_tokens_never_passes_the_response_cap(tiny_model, tmp_path):
    _, tok = tiny_model
    env = SAMPLING_ENV.replace('"max_tokens": 2', '"max_tokens": 1000')
    prompts = _labeled(tok, [("q", "dict")])
    turn, long = _enc(tok, " 1"), _enc(tok, " 1 2 3 4 5 6 7 8 9")
    seen = []
    engine = ScriptedEngine({prompts[0][0]: [turn, long]}, truncate={(prompts[0][0], 1)}, check=seen.append)
    cap = len(turn) + len(_enc(tok, " again:")) + 5
    ro = EnvRollout(engine, tok, load_environment(_env_file(tmp_path, env)), cap).generate(
        prompts, SamplingParams(max_new_tokens=3))
    assert seen[1].max_new_tokens == 5 and ro.response_lengths.tolist() == [cap] and ro.truncated.tolist() == [True]


@pytest.mark.parametrize("how, expect", [
    ("out['sampling_params'] = {'temperature': -1}", "sampling_params temperature=-1; give a number >= 0"),
    ("out['sampling_params'] = {'top_p': 'high'}", "sampling_params top_p='high'; give a number in (0, 1]"),
    ("out['sampling_params'] = {'max_tokens': 0}", "max_tokens=0; give an integer >= 1"),
    ("out['sampling_params'] = {'top_k': 2.5}", "top_k=2.5; give an integer >= 1, or -1 or 0"),
    ("out['sampling_params'] = {'n': 4}", "n=4; give 1"),
    ("out['sampling_params'] = {'stop': [1]}", "stop=[1]; give a string or a list of strings"),
    ("out['sampling_params'] = {'presence_penalty': 1.0}", "'presence_penalty', which alignrl does not apply"),
    ("sp.logprobs = 1", "set sampling_params.logprobs, which alignrl does not apply"),
    ("out['sampling_params'] = 3", "returned a int as 'sampling_params'"),
])
def test_sampling_params_alignrl_cannot_apply_are_one_line(tiny_model, tmp_path, how, expect):
    _, tok = tiny_model
    prompts = _labeled(tok, [("q", how)])
    engine = ScriptedEngine({prompts[0][0]: [_enc(tok, " 1")] * 2})
    with pytest.raises(EnvironmentStepError) as err:
        EnvRollout(engine, tok, load_environment(_env_file(tmp_path)), 64).generate(prompts, SamplingParams())
    assert expect in one_line(str(err.value)) and "AgentInstance.step" in str(err.value)


LONG_ENV = '''
from openrlhf.utils.agent import AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.steps = 0

    async def step(self, states, **kwargs):
        self.steps += 1
        return {"rewards": 1.0, "environment_feedback": " more:",
                "done": self.steps >= 2}
'''


def test_a_short_prompt_lends_its_unused_length_to_the_response(tiny_model, tmp_path):
    from alignrl.rl.scoring import RewardStage

    _, tok = tiny_model
    short, full = _enc(tok, "q"), _enc(tok, "w e r t y u")
    room = len(full)  # the prompt cap: `full` fills it, `short` leaves room - len(short) to its response
    prompts = [TaskPrompt(ids, Sample([{"role": "user", "content": "x"}], "5")) for ids in (short, full)]
    turn = _enc(tok, " 1 2 3 4 5 6 7 8 9 10 11 12")
    seen = []
    engine = ScriptedEngine({short[0]: [turn, turn], full[0]: [turn, turn]}, truncate={}, check=seen.append)
    cap = 8
    make = load_environment(_env_file(tmp_path, LONG_ENV))
    ro = EnvRollout(engine, tok, make, cap, prompt_room=room).generate(prompts, SamplingParams(max_new_tokens=4))
    lent = room - len(short)
    # each turn may take all the room left (OpenRLHF's max_tokens = budget - tokens so far), not max_new_tokens
    assert seen[0].max_new_tokens == cap + lent
    assert ro.response_lengths.tolist() == [cap + lent, cap] and ro.truncated.tolist() == [True, True]
    assert ro.response_ids.shape[1] == cap + lent > cap  # padded to the longest, past the run's response cap
    scores = RewardStage(tok, None, None, cap, overlong_buffer_len=2).score(ro, [p.sample for p in prompts])
    assert scores.rewards.tolist() == [0.0, 0.0]  # the overlong penalty clamps a length past the cap to -1
    seen.clear()
    without = EnvRollout(ScriptedEngine({short[0]: [turn, turn], full[0]: [turn, turn]}, check=seen.append), tok,
                         make, cap).generate(prompts, SamplingParams(max_new_tokens=4))
    # off by default: the run's own caps, as before (turns of max_new_tokens, responses within the cap)
    assert seen[0].max_new_tokens == 4 and without.response_ids.shape[1] <= cap


def test_grpo_trains_on_responses_longer_than_the_cap_when_prompts_lend(tiny_model_dir, tmp_path, cli_in_process):
    """Two GRPO steps of the tiny model whose episodes are budgeted as OpenRLHF budgets them (agent.lend_prompt_room,
    which --agent_func_path sets): the padded tensors and the trainer take responses longer than the response cap."""
    from conftest import SMALL_GRPO, run_settings

    path = _env_file(tmp_path, LONG_ENV.replace("self.steps >= 2", "self.steps >= 3"))
    got = cli_in_process("train", "grpo", *SMALL_GRPO, f"model.path={tiny_model_dir}",
                         *run_settings(tmp_path / "out", "lend", 2), f"agent.env_path={path}",
                         "agent.max_response_length=8", "data.max_prompt_length=128", "agent.lend_prompt_room=true")
    assert got.returncode == 0, got.stderr[-3000:] + got.stdout[-3000:]
    metrics = tmp_path / "out" / "lend" / "logs" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in rows if "agent/turns" in r]
    assert len(steps) == 2
    assert max(r["response/length_max"] for r in steps) > 8  # past agent.max_response_length: the prompts lent


def test_lending_needs_an_environment_and_the_environments_rollout_gets_the_prompt_cap(tiny_model, tmp_path):
    from alignrl.config import ConfigError, load_config
    from alignrl.placements.episodes import with_tools

    with pytest.raises(ConfigError, match="set agent.env_path, or drop agent.lend_prompt_room"):
        load_config(None, ["agent.lend_prompt_room=true"])
    path = _env_file(tmp_path, LONG_ENV)
    cfg = load_config(None, [f"agent.env_path={path}", "agent.lend_prompt_room=true", "data.max_prompt_length=96"])
    assert with_tools(cfg, ScriptedEngine({}), tiny_model[1]).prompt_room == 96
    cfg = load_config(None, [f"agent.env_path={path}", "data.max_prompt_length=96"])
    assert with_tools(cfg, ScriptedEngine({}), tiny_model[1]).prompt_room == 0  # alignrl's own keys: its own cap
