"""verl's interactions (agent.interaction_config_path, verl's multi_turn.interaction_config_path): the interaction
config YAML and its one-line errors, the built-in gsm8k interaction, a user's interaction class running without
verl, episodes where the interaction answers turns without tool calls as a user until it ends them, and verl's
gsm8k-with-interaction example training."""

import asyncio
import json
import sys

import pytest

from alignrl.data.collate import prompt_ids
from alignrl.data.records import Sample
from alignrl.interfaces import SamplingParams
from alignrl.rollout.env_agent import EnvRollout, TaskPrompt
from alignrl.rollout.verl_interactions import (Gsm8kInteraction, InteractionConfigError, InteractionError, UserChat,
                                               default_name, load_interactions)
from alignrl.rollout.verl_tools import ToolLoop, tool_environment
from conftest import one_line
from scripted_engine import ScriptedEngine

pytestmark = pytest.mark.timeout(240)

GSM8K_YAML = """interaction:
  - name: "gsm8k"
    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
    config: {}
"""
WRONG, RIGHT = Gsm8kInteraction.WRONG, Gsm8kInteraction.RIGHT

# a user's interaction as verl's docs write one: verl's base imported by name
USER_INTERACTION = '''
from typing import Any, Optional
from uuid import uuid4

from verl.interactions.base import BaseInteraction

SEEN = []


class CountingInteraction(BaseInteraction):
    """Ends the episode at its config's `turns`-th reply; records what it is given."""

    def __init__(self, config: dict):
        super().__init__(config)
        self.turns = config.get("turns", 2)
        self.replies = {}

    async def start_interaction(self, instance_id: Optional[str] = None, **kwargs) -> str:
        SEEN.append(("start", instance_id, dict(kwargs)))
        self.replies[instance_id] = 0
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        self.replies[instance_id] += 1
        n = self.replies[instance_id]
        SEEN.append(("reply", [dict(m) for m in messages], kwargs.get("tag")))
        if kwargs.get("tag") == "boom":
            raise RuntimeError("the simulated user crashed")
        if kwargs.get("tag") == "bad":
            return "not a tuple"
        return n >= self.turns, f"reply {n}", None if n == 1 else 0.5, {}

    async def finalize_interaction(self, instance_id, **kwargs):
        SEEN.append(("finalize", instance_id))


class OldStyleInteraction(BaseInteraction):
    """verl's base replies; finalize_interaction without the instance id, as older verl's base declared it."""

    async def finalize_interaction(self):
        SEEN.append(("old-finalize",))


class SyncInteraction(BaseInteraction):
    def generate_response(self, instance_id, messages, **kwargs):
        return True, "", 0.0, {}


class Raising(BaseInteraction):
    def __init__(self, config):
        raise ValueError("needs an endpoint")
'''


def _yaml(tmp_path, text=GSM8K_YAML, name="interaction_config.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module of the working folder with the user's interactions, a name of its own per test (imported afresh)."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    monkeypatch.chdir(tmp_path)
    module = f"user_interactions_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{module}.py").write_text(USER_INTERACTION)
    return module


def test_the_gsm8k_interaction_scores_the_last_answer_and_ends_on_a_right_one(tmp_path):
    got = load_interactions(_yaml(tmp_path))
    assert list(got) == ["gsm8k"] and isinstance(got["gsm8k"], Gsm8kInteraction) and got["gsm8k"].name == "gsm8k"
    gsm = got["gsm8k"]

    async def episode():
        i = await gsm.start_interaction("id", name="gsm8k", query="q", ground_truth="72")
        chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "6 * 12 = 72, so #### 72"},
                {"role": "user", "content": "earlier reply"}]
        right = await gsm.generate_response(i, chat, name="gsm8k")
        wrong = await gsm.generate_response(i, chat + [{"role": "assistant", "content": "#### 7"}])
        bare = await gsm.generate_response(i, chat + [{"role": "assistant", "content": "it is 72"}])  # flexible
        none = await gsm.generate_response(i, [{"role": "user", "content": "q"}])  # no answer yet
        await gsm.finalize_interaction(i)
        j = await gsm.start_interaction(None)  # no ground truth: nothing is right
        return right, wrong, bare, none, await gsm.generate_response(j, chat), j

    right, wrong, bare, none, unlabeled, j = asyncio.run(episode())
    assert right == (True, RIGHT, 1.0, {}) and bare == (True, RIGHT, 1.0, {})
    assert wrong == (False, WRONG, 0.0, {}) and none == (False, WRONG, 0.0, {}) and unlabeled[:3] == (False, WRONG,
                                                                                                        0.0)
    assert list(gsm._instances) == [j]  # finalized instances are released
    assert default_name("pkg.mod.WeatherInteraction") == "weather" and default_name("pkg.Helper") == "helper"


def test_a_users_interaction_runs_without_verl_and_is_named_after_its_class(tmp_path, user_module):
    path = _yaml(tmp_path, f"interaction:\n  - class_name: {user_module}.CountingInteraction\n"
                           "    config: {turns: 3}\n  - name: gsm8k\n"
                           "    class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction\n")
    got = load_interactions(path)
    assert list(got) == ["counting", "gsm8k"]
    assert got["counting"].config == {"turns": 3, "name": "counting"} and got["counting"].turns == 3
    from verl.interactions.base import BaseInteraction  # provided under verl's name

    assert isinstance(got["counting"], BaseInteraction)


def test_the_base_interactions_replies_and_a_finalize_without_an_id(tiny_model, tmp_path, user_module):
    from alignrl.rollout.verl_interactions import Interactions

    _, tok = tiny_model
    interactions = Interactions(_yaml(tmp_path, f"interaction:\n  - class_name: {user_module}.OldStyleInteraction\n"),
                                tok)
    row = Sample([{"role": "user", "content": "q"}], "1", extra={"interaction_kwargs": {"name": "oldstyle"}})

    async def episode():
        talk = await interactions.start(row)
        talk.assistant("an answer")
        got = await talk.reply()
        await talk.finish()
        return talk, got, await interactions.start(Sample([{"role": "user", "content": "q"}], "1"))

    talk, (text, done), unplayed = asyncio.run(episode())
    assert text == UserChat(tok).feedback("Your current result seems acceptable.") and done is False
    assert talk.scores == [0.8] and talk.logs() == {"interaction_turns": 1.0, "interaction_score": 0.8,
                                                    "interaction_score_mean": 0.8}
    assert [m["role"] for m in talk.messages] == ["user", "assistant", "user"]
    assert sys.modules[user_module].SEEN == [("old-finalize",)] and unplayed is None


@pytest.mark.parametrize("text, expect", [
    (None, "no such file"),
    ("interaction: [", "is not valid YAML"),
    ("tools: []", "has no 'interaction' list"),
    ("interaction:\n  - name: x\n", "interaction[0] has no class_name"),
    ("interaction:\n  - class_name: Gsm8kInteraction\n", "is not a module path"),
    ("interaction:\n  - class_name: no_such_module_xyz.Thing\n", "module no_such_module_xyz failed to import"),
    ("interaction:\n  - class_name: {m}.Missing\n", "has no class Missing"),
    ("interaction:\n  - class_name: {m}.SyncInteraction\n", "has no async generate_response()"),
    ("interaction:\n  - class_name: {m}.Raising\n", "raised ValueError: needs an endpoint"),
    ("interaction:\n  - class_name: {m}.CountingInteraction\n    config: [1]\n", "config is a list"),
    ("interaction:\n  - class_name: {m}.CountingInteraction\n  - name: counting\n    class_name: "
     "{m}.CountingInteraction\n", "'counting' is given twice"),
])
def test_a_bad_interaction_config_is_one_line(tmp_path, user_module, text, expect):
    path = str(tmp_path / "missing.yaml") if text is None else _yaml(tmp_path, text.format(m=user_module))
    with pytest.raises(InteractionConfigError) as err:
        load_interactions(path)
    assert expect in one_line(str(err.value)) and "agent.interaction_config_path=" in str(err.value)


def _enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _rows(tok, kwargs_per_row):
    rows = [Sample([{"role": "user", "content": f"question {i}"}], "72", "openai/gsm8k",
                   extra=None if kw is None else {"interaction_kwargs": kw}) for i, kw in enumerate(kwargs_per_row)]
    return rows, [TaskPrompt(prompt_ids(tok, r), r) for r in rows]


def _engine(prompts, turns):
    """Scripted turns per prompt, keyed by the prompt an episode started from."""
    script = {tuple(p): t for p, t in zip(prompts, turns)}
    return ScriptedEngine(script, key=lambda ids: next(k for k in script if tuple(ids[:len(k)]) == k))


def test_the_gsm8k_interaction_answers_as_a_user_until_the_answer_is_right(tiny_model, tmp_path):
    from alignrl.rewards.registry import default_compute_score
    from alignrl.rl.scoring import RewardStage

    _, tok = tiny_model
    truth = {"name": "gsm8k", "query": "q", "ground_truth": "72"}
    rows, prompts = _rows(tok, [truth, None])
    wrong, right = _enc(tok, " so #### 7"), _enc(tok, " so #### 72")
    engine = _engine(prompts, [[wrong, right], [wrong]])
    make = tool_environment("", tok, ToolLoop(), _yaml(tmp_path))
    ro = EnvRollout(engine, tok, make, response_cap=400).generate(prompts, SamplingParams(max_new_tokens=200))
    chat = UserChat(tok)
    told_wrong, told_right = _enc(tok, chat.feedback(WRONG)), _enc(tok, chat.feedback(RIGHT))
    assert chat.feedback("x") == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"  # the tiny template's turn
    first = ro.response_ids[0][ro.response_mask[0]].tolist()
    # the second turn reads the reply; the reply that ends the episode is appended too, as verl appends it
    assert first == wrong + told_wrong + right + told_right
    assert engine.calls[1][0][0] == list(prompts[0]) + wrong + told_wrong
    assert ro.loss_mask[0][ro.response_mask[0]].tolist() == [True] * len(wrong) + [False] * len(told_wrong) + \
        [True] * len(right) + [False] * len(told_right)
    # a row without interaction_kwargs runs the tool loop alone: its turn without calls ends it
    assert ro.response_ids[1][ro.response_mask[1]].tolist() == wrong
    assert ro.stats["turns"].tolist() == [2.0, 1.0] and ro.stats["env/verl_num_turns"].tolist() == [5.0, 2.0]
    assert ro.stats["env/interaction_turns"].tolist()[0] == 2.0
    assert ro.stats["env/interaction_score"].tolist()[0] == 1.0
    assert ro.stats["env/interaction_score_mean"].tolist()[0] == 0.5
    assert ro.truncated.tolist() == [False, False] and "env_reward" not in ro.stats
    # the reward is the run's reward function on the whole response, as in verl: the last answer is 72
    stage = RewardStage(tok, default_compute_score, default_compute_score, 400)
    assert stage.score(ro, rows).rewards.tolist() == [1.0, 0.0]
    assert asyncio.run(make()).interactions.by_name["gsm8k"]._instances == {}  # every episode was finalized


def test_turn_limits_end_the_conversation_and_each_episode_is_finalized(tiny_model, tmp_path, user_module):
    _, tok = tiny_model
    path = _yaml(tmp_path, f"interaction:\n  - name: user\n    class_name: {user_module}.CountingInteraction\n"
                           "    config: {turns: 9}\n")
    rows, prompts = _rows(tok, [{"name": "user", "tag": "a"}] * 2)
    turn = _enc(tok, " hello")
    for loop, turns in ((ToolLoop(max_assistant_turns=3), 3.0), (ToolLoop(max_user_turns=1), 2.0)):
        engine = _engine(prompts[:1], [[turn] * 5])
        make = tool_environment("", tok, loop, path)
        seen = sys.modules[user_module].SEEN
        seen.clear()
        ro = EnvRollout(engine, tok, make, response_cap=400, max_turns=loop.max_assistant_turns).generate(
            prompts[:1], SamplingParams(max_new_tokens=20))
        assert ro.stats["turns"].tolist() == [turns]
        assert ro.stats["env/interaction_turns"].tolist() == [turns - 1]
        assert [s[0] for s in seen] == ["start"] + ["reply"] * int(turns - 1) + ["finalize"]
        assert seen[0][2] == {"name": "user", "tag": "a"}  # start_interaction gets the row's interaction_kwargs
    # the response cap: a reply that leaves no room ends the episode, cut, and it is finalized all the same
    seen.clear()
    engine = _engine(prompts[:1], [[turn] * 5])
    cap = len(turn) + len(_enc(tok, UserChat(tok).feedback("reply 1")))
    ro = EnvRollout(engine, tok, tool_environment("", tok, ToolLoop(), path), response_cap=cap).generate(
        prompts[:1], SamplingParams(max_new_tokens=20))
    assert ro.truncated.tolist() == [True] and [s[0] for s in seen] == ["start", "reply", "finalize"]


def test_tool_calls_are_answered_by_tools_and_the_rest_by_the_interaction(tiny_model, tmp_path, user_module):
    """Both configs: a turn with a call gets the tool's response, one without gets the interaction's reply; the
    interaction reads the whole conversation (assistant turns, tool responses, its earlier replies)."""
    from test_verl_tools import GSM8K_YAML as TOOLS, _call

    _, tok = tiny_model
    tools = tmp_path / "tool_config.yaml"
    tools.write_text(TOOLS)
    path = _yaml(tmp_path, f"interaction:\n  - name: user\n    class_name: {user_module}.CountingInteraction\n")
    rows, prompts = _rows(tok, [{"name": "user", "tag": "t"}])
    rows[0].extra["tools_kwargs"] = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}
    call, plain = _enc(tok, _call("calc_gsm8k_reward", "72")), _enc(tok, " I think 72")
    engine = _engine(prompts, [[call, plain, plain]])
    make = tool_environment(str(tools), tok, ToolLoop(), path)
    ro = EnvRollout(engine, tok, make, response_cap=600).generate(prompts, SamplingParams(max_new_tokens=200))
    assert ro.stats["turns"].tolist() == [3.0] and ro.stats["env/tool_calls"].tolist() == [1.0]
    assert ro.stats["env/verl_num_turns"].tolist() == [7.0]  # 3 assistant, 1 tool and 2 interaction turns, 1
    replies = [s[1] for s in sys.modules[user_module].SEEN if s[0] == "reply"]
    call_text = tok.decode(call, skip_special_tokens=True)
    assert [m["role"] for m in replies[1]] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert replies[1][1]["content"] == call_text and replies[1][2]["content"] == "Current parsed answer='72' reward=1.0"
    assert replies[1][4]["content"] == "reply 1" and replies[1][5]["content"] == tok.decode(plain,
                                                                                        skip_special_tokens=True)
    assert ro.stats["env/interaction_score"].tolist() == [0.5]  # the first reply's None score is not a score


@pytest.mark.parametrize("kwargs, expect", [
    ({"tag": "x"}, "extra_info.interaction_kwargs has no 'name'"),
    ({"name": "nobody"}, "interaction_kwargs.name='nobody' is not in agent.interaction_config_path="),
    ({"name": "user", "tag": "boom"}, "CountingInteraction.generate_response raised RuntimeError: the simulated"),
    ({"name": "user", "tag": "bad"}, "generate_response returned str 'not a tuple'; return (should_terminate"),
])
def test_an_interaction_that_fails_mid_episode_is_one_line(tiny_model, tmp_path, user_module, kwargs, expect):
    _, tok = tiny_model
    path = _yaml(tmp_path, f"interaction:\n  - name: user\n    class_name: {user_module}.CountingInteraction\n")
    rows, prompts = _rows(tok, [kwargs])
    engine = _engine(prompts, [[_enc(tok, " hi")] * 3])
    with pytest.raises(InteractionError) as err:
        EnvRollout(engine, tok, tool_environment("", tok, ToolLoop(), path), response_cap=100).generate(
            prompts, SamplingParams(max_new_tokens=20))
    assert expect in one_line(str(err.value))


def test_the_key_translates_builds_the_loop_and_is_refused_beside_an_environment(tiny_model, tmp_path):
    from alignrl.config import ConfigError, load_config
    from alignrl.config.checks import response_cap
    from alignrl.placements.episodes import with_tools

    _, tok = tiny_model
    path = _yaml(tmp_path)
    R = "actor_rollout_ref.rollout.multi_turn."
    cfg = load_config(None, [f"{R}interaction_config_path={path}", f"{R}max_assistant_turns=3",
                             f"{R}max_user_turns=null", "data.max_response_length=64"])
    assert (cfg.agent.interaction_config_path, cfg.agent.tool_config_path, cfg.agent.max_turns) == (path, "", 3)
    assert load_config(None, [f"{R}interaction_config_path=null"]).agent.interaction_config_path == ""
    # the episode's cap is the tool loop's, not Search-R1's (agent.max_turns alone would be its search agent)
    assert response_cap(cfg) == (cfg.agent.max_response_length or cfg.rollout.max_new_tokens)
    built = with_tools(cfg, _engine([], []), tok)
    assert isinstance(built, EnvRollout) and built.max_turns == 3 and built.gives_rewards is False
    env = asyncio.run(built.make_env())
    assert env.tools == {} and env.chat is None and list(env.interactions.by_name) == ["gsm8k"]
    env_file = tmp_path / "agent_func.py"
    env_file.write_text("")
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"agent.interaction_config_path={path}", f"agent.env_path={env_file}"])
    assert "agent.env_path and agent.interaction_config_path each run the episodes" in one_line(str(err.value))
    with pytest.raises(ConfigError, match="an interaction's replies"):
        load_config(None, [f"agent.interaction_config_path={path}", "actor.state_masking=false",
                           "actor.recompute_old_logprobs=false"])


GSM8K_MULTITURN_GRPO = """hydra:
  searchpath:
    - file://verl/trainer/config

defaults:
  - ppo_trainer
  - _self_

data:
  max_prompt_length: 1024
  max_response_length: 1024
  train_batch_size: 256
  return_raw_chat: True

actor_rollout_ref:
  hybrid_engine: True
  rollout:
    name: sglang
    multi_turn:
      enable: True
      max_assistant_turns: 5
"""

SYSTEM = ("You are a math expert. You are given a question and you need to solve it step by step. You should "
          "rethinking carefully if user point out your answer is wrong. Put your final answer in the format of "
          "`#### <answer>`.")


def _gsm8k_rows(split: str, n: int) -> list[dict]:
    """verl's layout (examples/data_preprocess/gsm8k_multiturn_w_interaction.py)."""
    qa = [("Natalia sold 48 clips in April and half as many in May. How many in all?", "72"),
          ("Weng earns $12 an hour. How much for 50 minutes of babysitting?", "10")]
    out = []
    for i in range(n):
        q, a = qa[i % 2]
        question = q + " Let's think step by step and output the final answer after `####`."
        out.append({"data_source": "openai/gsm8k",
                    "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                    "ability": "math", "reward_model": {"style": "rule", "ground_truth": a},
                    "extra_info": {"split": split, "index": i, "answer": f"... #### {a}", "question": q,
                                   "interaction_kwargs": {"name": "gsm8k", "query": question, "ground_truth": a}}})
    return out


def test_verls_gsm8k_interaction_example_trains(tiny_model_dir, tmp_path, cli_in_process, monkeypatch):
    """examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn_w_interaction.sh as written (sizes cut to the tiny
    model), its gsm8k_multiturn_grpo.yaml, its interaction config and data layout: two GRPO steps in which the
    gsm8k interaction answers every turn."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.chdir(tmp_path)
    (tmp_path / "config" / "interaction_config").mkdir(parents=True)
    (tmp_path / "config" / "gsm8k_multiturn_grpo.yaml").write_text(GSM8K_MULTITURN_GRPO)
    (tmp_path / "config" / "interaction_config" / "gsm8k_interaction_config.yaml").write_text(GSM8K_YAML)
    pq.write_table(pa.Table.from_pylist(_gsm8k_rows("train", 4)), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(_gsm8k_rows("test", 2)), tmp_path / "test.parquet")
    got = cli_in_process(
        "train", "ppo", f"--config-path={tmp_path / 'config'}", "--config-name=gsm8k_multiturn_grpo",
        "algorithm.adv_estimator=grpo", "data.train_batch_size=2", "data.max_prompt_length=1024",
        "data.max_response_length=12", "data.filter_overlong_prompts=True", "data.truncation='error'",
        # the tiny model never ends a turn itself: each turn is data.max_response_length tokens, so the episode's
        # cap (verl's rollout.response_length, data.max_response_length unless given) leaves room for more turns
        "actor_rollout_ref.rollout.response_length=300",
        "data.return_raw_chat=True", f"actor_rollout_ref.model.path={tiny_model_dir}",
        "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "+actor_rollout_ref.model.enable_activation_offloading=True", "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.fsdp_config.param_offload=True",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.name=sglang",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.8", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True", "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0", "trainer.logger=['console','jsonl']", "trainer.project_name='gsm8k_async_rl'",
        "trainer.experiment_name='qwen2.5-3b_function_rm-gsm8k-sgl-multi-w-interaction-n8'",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.save_freq=-1", "trainer.test_freq=20",
        "data.train_files=train.parquet", "data.val_files=test.parquet",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path="
        f"{tmp_path / 'config' / 'interaction_config' / 'gsm8k_interaction_config.yaml'}",
        "trainer.total_epochs=15", "trainer.total_training_steps=2", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        f"trainer.output_dir={tmp_path / 'out'}", "trainer.progress_bar=false")
    assert got.returncode == 0, got.stderr[-3000:] + got.stdout[-3000:]
    rows = [json.loads(line) for line in
            next((tmp_path / "out").glob("*/logs/metrics.jsonl")).read_text().splitlines()]
    steps = [r for r in rows if "agent/turns" in r]
    assert [r["step"] for r in steps] == [1, 2], steps
    # the tiny model never answers right: the interaction asks again after each turn, up to max_assistant_turns
    assert all(r["agent/interaction_turns"] >= 1.0 and r["agent/turns"] > 1.0 for r in steps), steps
