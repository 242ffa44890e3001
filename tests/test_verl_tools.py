"""verl's tool agent loop (agent.tool_config_path, verl's multi_turn.tool_config_path): the tool config YAML and its
one-line errors, the hermes parser, a user's BaseTool running without verl, and episodes whose tool responses are
appended in chat-template form between the turns' generated ids, scored by the run's reward function."""

import asyncio
import copy
import json
import sys
import textwrap

import pytest

from alignrl.data.collate import prompt_ids
from alignrl.data.records import Sample
from alignrl.interfaces import SamplingParams
from alignrl.rollout.env_agent import EnvRollout, TaskPrompt
from alignrl.rollout.tool_calls import ToolChat, ToolTemplateError, parse_hermes, truncate_response
from alignrl.rollout.verl_tools import ToolConfigError, ToolLoop, ToolResultError, load_tools, tool_environment
from conftest import one_line
from scripted_engine import ScriptedEngine as Scripted

pytestmark = pytest.mark.timeout(240)

SCHEMA = """
    tool_schema:
      type: "function"
      function:
        name: "{name}"
        description: "A tool for calculating the reward of gsm8k"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""
GSM8K_YAML = 'tools:\n  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"\n    config: {type: native}' + \
    SCHEMA.format(name="calc_gsm8k_reward")

# a user's tool as verl's docs write one: verl's modules imported by name, ToolResponse returned
ECHO_TOOL = '''
from typing import Any, Optional
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.rollout_trace import rollout_trace_op

CALLS = []


class EchoTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self.prefix = config.get("prefix", "")

    async def create(self, instance_id: Optional[str] = None, **kwargs):
        CALLS.append(("create", kwargs.get("create_kwargs")))
        return instance_id or str(uuid4()), ToolResponse()

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        if parameters.get("answer") == "boom":
            raise RuntimeError("boom")
        if parameters.get("answer") == "image":
            return ToolResponse(text="x", image=["img"]), 0.0, {}
        return ToolResponse(text=self.prefix + parameters["answer"]), 0.0, {}

    async def release(self, instance_id: str, **kwargs):
        CALLS.append(("release", instance_id))


class NotATool:
    pass
'''


def _call(name, answer):
    return f'<tool_call>{{"name": "{name}", "arguments": {{"answer": "{answer}"}}}}</tool_call>'


def _enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _yaml(tmp_path, text=GSM8K_YAML, name="tool_config.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture
def user_tools(tmp_path, monkeypatch):
    """A module of the working folder defining EchoTool, importable as `<module>.EchoTool` (a name of its own per
    test, so each imports afresh); sys.path is restored after."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    monkeypatch.chdir(tmp_path)
    module = f"user_tools_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{module}.py").write_text(ECHO_TOOL)
    return module


def _echo_yaml(tmp_path, module, prefix=""):
    return _yaml(tmp_path, f'tools:\n  - class_name: "{module}.EchoTool"\n    config: {{type: native, prefix: '
                 f'"{prefix}"}}' + SCHEMA.format(name="echo"), "echo.yaml")


def test_hermes_parses_calls_in_order_and_counts_malformed_ones():
    calls, bad = parse_hermes("think " + _call("a", "1") + " then " + _call("b", "2"))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"answer": "1"}), ("b", {"answer": "2"})]
    assert bad == 0
    calls, bad = parse_hermes('<tool_call>{"name": "a", "arguments": {"x": </tool_call>' + _call("b", "2") +
                              '<tool_call>{"arguments": {}}</tool_call><tool_call>[1]</tool_call>')
    assert [c.name for c in calls] == ["b"] and bad == 3
    assert parse_hermes('<tool_call>{"name": "a", "arguments": {}}') == ([], 0)  # unclosed: no call, as in verl
    assert parse_hermes("no calls at all") == ([], 0)


@pytest.mark.parametrize("side, expect", [("left", "abcd...(truncated)"), ("right", "(truncated)...ghij"),
                                          ("middle", "ab...(truncated)...ij")])
def test_tool_responses_are_cut_as_verl_cuts_them(side, expect):
    assert truncate_response("abcdefghij", 4, side) == expect
    assert truncate_response("abcd", 4, side) == "abcd"


@pytest.mark.parametrize("text, expect", [
    (None, "no such file"),
    ("tools: [\n", "is not valid YAML"),
    ("tools: []\n", "has no 'tools' list"),
    ("tools:\n  - config: {}\n", "tools[0] has no class_name"),
    ('tools:\n  - class_name: "no_such_module_xyz.Tool"\n', "module no_such_module_xyz failed to import"),
    ('tools:\n  - class_name: "Tool"\n', "is not a module path"),
    ('tools:\n  - class_name: "json.NoSuchTool"\n', "json has no class NoSuchTool"),
    ('tools:\n  - class_name: "json.JSONDecoder"\n', "does not subclass verl's BaseTool"),
    ('tools:\n  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"\n    config: {type: mcp}\n', "is not supported"),
    ('tools:\n  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"\n    tool_schema: {type: function, function: '
     '{description: d, parameters: {type: object, properties: {}, required: []}}}\n', "function.name: Field required"),
    ('tools:\n  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"\n', "Gsm8kTool(config=..., tool_schema=...) raised"),
    (GSM8K_YAML + GSM8K_YAML.split("tools:\n")[1], "tool name 'calc_gsm8k_reward' is given twice"),
])
def test_a_bad_tool_config_is_one_line(tmp_path, text, expect):
    path = _yaml(tmp_path, text) if text is not None else str(tmp_path / "missing.yaml")
    with pytest.raises(ToolConfigError) as err:
        load_tools(path)
    assert expect in one_line(str(err.value)) and "agent.tool_config_path" in str(err.value)


def test_a_user_tool_runs_without_verl(tiny_model, tmp_path, user_tools):
    _, tok = tiny_model
    (tool,) = load_tools(_echo_yaml(tmp_path, user_tools, prefix="got "))
    assert tool.name == "echo" and type(tool).__module__ == user_tools
    assert tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True)["function"]["name"] == "echo"
    with pytest.raises(ToolConfigError, match="NotATool' does not subclass"):
        load_tools(_yaml(tmp_path, f'tools:\n  - class_name: "{user_tools}.NotATool"\n', "not.yaml"))


def _env(tok, path, **loop):
    return asyncio.run(tool_environment(path, tok, ToolLoop(**loop))())


def _step(env, text):
    return asyncio.run(env.step({"observation_text": "", "action_text": text, "label": None}))


def test_parallel_calls_truncation_errors_and_turn_limits(tiny_model, tmp_path, user_tools):
    _, tok = tiny_model
    path = _echo_yaml(tmp_path, user_tools)
    env = _env(tok, path, max_parallel_calls=2, max_tool_response_length=4, truncate_side="left")
    row = Sample([{"role": "user", "content": "q"}], "1", extra={"tools_kwargs": {"echo": {"create_kwargs": {"k": 1}}}})
    asyncio.run(env.reset({"observation": "q", "label": "1", "sample": row}))
    got = _step(env, _call("echo", "abcdefgh") + _call("nope", "1") + _call("echo", "never"))
    chat = ToolChat(tok, [])
    assert got["done"] is False
    assert got["environment_feedback"] == chat.feedback(["abcd...(truncated)", "Error when executing tool: 'nope'"])
    assert got["extra_logs"] == {"tool_calls": 2.0, "tool_errors": 1.0, "tool_call_parse_errors": 0.0,
                                 "tool_calls_per_turn": 2.0, "verl_num_turns": 3.0}
    calls = sys.modules[user_tools].CALLS
    assert calls[0] == ("create", {"k": 1}) and calls[1][0] == "release"  # each call: created, released
    got = _step(env, _call("echo", "boom"))  # an exception in the tool: verl's error text, the episode goes on
    assert "Error when executing tool: boom" in got["environment_feedback"] and not got["done"]
    assert _step(env, "the answer")["done"] is True  # no call: the episode ends
    limited = _env(tok, path, max_user_turns=1)
    assert not _step(limited, _call("echo", "a"))["done"]
    last = _step(limited, _call("echo", "b"))  # one tool turn allowed: the second turn's call is not made
    assert last["done"] and last["extra_logs"]["tool_calls"] == 1.0
    assert _step(_env(tok, path, max_assistant_turns=1), _call("echo", "a"))["done"]
    with pytest.raises(ToolResultError, match="returned image"):
        _step(_env(tok, path), _call("echo", "image"))


QWENISH = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n' }}{% if tools %}{% for t in tools %}"
           "{{ t['function']['name'] }};{% endfor %}{% else %}{{ 'helpful' }}{% endif %}"
           "{{ '<|im_end|>\\n' }}{% endif %}"
           "{% for m in messages %}{% if m['role'] == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + "
           "m['content'] + '\\n</tool_response><|im_end|>\\n' }}{% elif m['role'] %}{{ '<|im_start|>' + m['role'] + "
           "'\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_prompt_carries_the_schemas_and_feedback_drops_the_empty_conversation_prefix(tiny_model, tmp_path):
    _, tok = tiny_model
    qwen = copy.deepcopy(tok)
    qwen.chat_template = QWENISH
    env = _env(qwen, _yaml(tmp_path))
    row = Sample([{"role": "user", "content": "q"}], "72")
    tooled = "<|im_start|>system\ncalc_gsm8k_reward;<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    # the run's prompt, templated with the schemas (and perhaps cut to data.max_prompt_length), is kept as given
    for given in (tooled, tooled[-30:]):
        assert asyncio.run(env.reset({"observation": given, "label": "72", "sample": row})) == {"observation": given}
    # one templated without them (a caller that did not pass them) gets them
    bare = "<|im_start|>system\nhelpful<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    assert asyncio.run(env.reset({"observation": bare, "label": "72", "sample": row})) == {"observation": tooled}
    # verl's system_prompt ("helpful", the template's empty conversation) is cut from the tool turn's text
    assert ToolChat(qwen, []).feedback(["R"]) == "<|im_start|>user\n<tool_response>\nR\n</tool_response><|im_end|>\n" \
                                                 "<|im_start|>assistant\n"
    # a prompt used without a chat template (prompt_text) is kept as it is
    plain = Sample([{"role": "user", "content": "q"}], "72", prompt_text="Q: q")
    assert asyncio.run(env.reset({"observation": "Q: q", "label": "72", "sample": plain})) == {"observation": "Q: q"}
    strict = copy.deepcopy(tok)
    strict.chat_template = "{{ raise_exception('no tool role') }}"
    with pytest.raises(ToolTemplateError, match="cannot render a tool message"):
        ToolChat(strict, [])


def ScriptedEngine(script: dict[tuple, list[list[int]]]):  # noqa: N802
    """The shared engine keyed by the prompt an episode started from (its leading ids)."""
    return Scripted(script, key=lambda p: next(k for k in script if tuple(p[:len(k)]) == k))


def test_a_gsm8k_episode_keeps_ids_appends_the_tool_turn_and_is_scored_by_the_reward_function(tiny_model, tmp_path):
    from alignrl.rewards.registry import default_compute_score
    from alignrl.rl.scoring import RewardStage

    _, tok = tiny_model
    rows = [Sample([{"role": "user", "content": f"question {q}"}], "72",
                   extra={"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}})
            for q in ("one", "two")]
    prompts = [TaskPrompt(prompt_ids(tok, r), r) for r in rows]
    call, right, wrong = _enc(tok, _call("calc_gsm8k_reward", "72")), _enc(tok, " so #### 72"), _enc(tok, " #### 5")
    engine = ScriptedEngine({tuple(prompts[0]): [call, right], tuple(prompts[1]): [call, wrong]})
    make = tool_environment(_yaml(tmp_path), tok, ToolLoop())
    ro = EnvRollout(engine, tok, make, response_cap=400).generate(prompts, SamplingParams(max_new_tokens=200))
    feedback = _enc(tok, "<|im_start|>tool\nCurrent parsed answer='72' reward=1.0<|im_end|>\n<|im_start|>assistant\n")
    first = ro.response_ids[0][ro.response_mask[0]].tolist()
    assert first == call + feedback + right  # token in, token out: the turns' ids, the tool turn between
    assert ro.loss_mask[0][ro.response_mask[0]].tolist() == [True] * len(call) + [False] * len(feedback) + \
        [True] * len(right)
    assert (ro.logprobs[0][len(call):len(call) + len(feedback)] == 0).all()
    assert engine.calls[1][0][0] == list(prompts[0]) + call + feedback  # the answer turn reads the tool's response
    assert ro.prompt_ids[0][ro.prompt_mask[0]].tolist() == list(prompts[0])  # the tiny template prints no tools
    assert ro.stats["turns"].tolist() == [2.0, 2.0] and ro.stats["env/tool_calls"].tolist() == [1.0, 1.0]
    assert "env_reward" not in ro.stats  # the steps give no reward: the reward function scores the response
    stage = RewardStage(tok, default_compute_score, default_compute_score, 400)
    assert stage.score(ro, rows).rewards.tolist() == [1.0, 0.0]


GEO3K_YAML = 'tools:\n  - class_name: "verl.tools.geo3k_tool.Geo3kTool"\n    config: {}' + \
    '\n    tool_schema: {type: function, function: {name: calc_geo3k_reward, description: grade, ' + \
    'parameters: {type: object, properties: {answer: {type: string}}, required: [answer]}}}\n'


def test_an_image_prompt_keeps_its_images_through_every_tool_turn(tiny_model, tmp_path):
    """verl's multi-turn geo3k example: prompts with images in the tool loop. Every turn is generated with the prompt's
    images, the tool (verl's Geo3kTool) grades the answer, and the rollout hands the images to the trainer's
    forwards; an environment that rewrites an image prompt's observation is one line."""
    import torch

    from alignrl.data.images import ImagePrompt, PromptImages
    from alignrl.rollout.env_agent import EnvironmentStepError

    _, tok = tiny_model
    pictures = PromptImages(torch.zeros(4, 6), torch.tensor([[1, 2, 2]]))
    row = Sample([{"role": "user", "content": "<image>angle?"}], "30",
                 extra={"tools_kwargs": {"calc_geo3k_reward": {"create_kwargs": {"ground_truth": "30"}}}})
    prompt = TaskPrompt(ImagePrompt(prompt_ids(tok, row), pictures), row)
    call, answer = _enc(tok, _call("calc_geo3k_reward", "30")), _enc(tok, " \\boxed{30}")
    engine = ScriptedEngine({tuple(prompt): [call, answer]})
    make = tool_environment(_yaml(tmp_path, GEO3K_YAML), tok, ToolLoop())
    seen = []
    generate = engine.generate
    engine.generate = lambda prompts, params: (seen.extend(getattr(p, "images", None) for p in prompts),
                                               generate(prompts, params))[1]
    ro = EnvRollout(engine, tok, make, response_cap=400).generate([prompt], SamplingParams(max_new_tokens=200))
    assert seen == [pictures, pictures]  # the tool turn and the answer turn both saw the picture
    assert "reward=1.0" in tok.decode(engine.calls[1][0][0][len(prompt) + len(call):])
    assert ro.images is not None and ro.images.rows == [pictures]
    assert ro.reward_extras[0]["tool_rewards"] == [0.0]  # the first right answer improved on 0.0

    class Rewriting:
        async def reset(self, states):
            return {"observation": states["observation"] + " more"}

    async def rewriter():  # an environment factory, as OpenRLHF's AgentInstance is made
        return Rewriting()

    with pytest.raises(EnvironmentStepError, match="rewrote the observation of a prompt with images"):
        EnvRollout(engine, tok, rewriter, response_cap=400).generate([prompt], SamplingParams(max_new_tokens=20))


def test_a_turn_cut_at_the_response_cap_runs_no_tool_calls(tiny_model, tmp_path, user_tools):
    _, tok = tiny_model
    rows = [Sample([{"role": "user", "content": f"question {q}"}], "1") for q in ("one", "two")]
    prompts = [TaskPrompt(prompt_ids(tok, r), r) for r in rows]
    call = _enc(tok, _call("echo", "x"))
    feedback = _enc(tok, ToolChat(tok, []).feedback(["x"]))
    cap = len(call) + len(feedback) + 4
    tail = _enc(tok, " and then some more words that run past the cap")
    assert len(tail) > len(feedback) + 4
    # the first episode's call is whole but its turn is cut at the cap: verl ends on length before parsing tools
    script = {tuple(prompts[0]): [call + tail], tuple(prompts[1]): [call, _enc(tok, " ok")]}
    engine = Scripted(script, truncate={(tuple(prompts[0]), 0)}, key=ScriptedEngine(script).key)  # at its length limit
    make = tool_environment(_echo_yaml(tmp_path, user_tools), tok, ToolLoop())
    ro = EnvRollout(engine, tok, make, response_cap=cap).generate(prompts, SamplingParams(max_new_tokens=200))
    executed = [c for c in sys.modules[user_tools].CALLS if c[0] == "create"]
    assert len(executed) == 1 and ro.stats["env/tool_calls"].tolist() == [0.0, 1.0]
    assert ro.truncated.tolist() == [True, False] and ro.stats["turns"].tolist() == [1.0, 2.0]
    assert ro.response_ids[1][ro.response_mask[1]].tolist() == call + feedback + _enc(tok, " ok")
    # verl's num_turns: the prompt, the assistant turns and the tool turns
    assert ro.stats["env/verl_num_turns"].tolist() == [2.0, 4.0]


def test_with_tools_builds_the_loop_and_the_config_refuses_it_beside_an_environment(tiny_model, tmp_path):
    from alignrl.config import ConfigError, load_config
    from alignrl.placements.episodes import with_tools

    _, tok = tiny_model
    path = _yaml(tmp_path)
    cfg = load_config(None, [f"agent.tool_config_path={path}", "agent.max_parallel_calls=3", "agent.max_turns=4",
                             "agent.tool_response_truncate_side=left"])
    built = with_tools(cfg, ScriptedEngine({}), tok)
    assert isinstance(built, EnvRollout) and built.max_turns == 4 and built.gives_rewards is False
    env = asyncio.run(built.make_env())
    assert env.loop == ToolLoop(4, 0, 3, 256, "left", "hermes") and list(env.tools) == ["calc_gsm8k_reward"]
    env_file = tmp_path / "agent_func.py"
    env_file.write_text("")
    with pytest.raises(ConfigError) as err:  # refused when the config loads, before anything is built
        load_config(None, [f"agent.tool_config_path={path}", f"agent.env_path={env_file}"])
    assert "give one of them" in one_line(str(err.value))
    with pytest.raises(ConfigError, match="set actor.recompute_old_logprobs=true"):
        load_config(None, [f"agent.tool_config_path={path}", "actor.state_masking=false",
                           "actor.recompute_old_logprobs=false"])
    with pytest.raises(ConfigError, match="tool_response_truncate_side='top' is not allowed"):
        load_config(None, [f"agent.tool_config_path={path}", "agent.tool_response_truncate_side=top"])


def test_grpo_trains_with_the_tool_loop(tiny_model_dir, tmp_path, cli_in_process):
    """Two GRPO steps of the tiny model in verl's tool loop: the run's metrics carry the turns and the tool counts."""
    from conftest import SMALL_GRPO, run_settings

    got = cli_in_process("train", "grpo", *SMALL_GRPO, f"model.path={tiny_model_dir}",
                         *run_settings(tmp_path / "out", "tools", 2), f"agent.tool_config_path={_yaml(tmp_path)}",
                         "agent.max_turns=2", "agent.max_response_length=40")
    assert got.returncode == 0, got.stderr[-3000:] + got.stdout[-3000:]
    rows = [json.loads(line) for line in
            (tmp_path / "out" / "tools" / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "agent/turns" in r]
    assert len(steps) == 2 and all(1.0 <= r["agent/turns"] <= 2.0 and r["agent/tool_calls"] >= 0.0 for r in steps)


def test_verls_multi_turn_script_trains_through_its_config_path(tiny_model_dir, tmp_path, cli_in_process, monkeypatch):
    """verl's gsm8k multi-turn example as written: `--config-path DIR --config-name gsm8k_multiturn_grpo` (a config
    that extends ppo_trainer with multi_turn.enable and max_assistant_turns) and multi_turn.tool_config_path on the
    command line, over verl's GSM8K layout; two GRPO steps of the tiny model in the tool loop."""
    from test_verl07_scripts import grpo_math, write_math

    monkeypatch.chdir(tmp_path)
    (tmp_path / "gsm8k_multiturn_grpo.yaml").write_text(
        "hydra:\n  searchpath:\n    - file://verl/trainer/config\n\ndefaults:\n  - ppo_trainer\n  - _self_\n\n"
        "data:\n  max_prompt_length: 1024\n  max_response_length: 1024\n  train_batch_size: 256\n"
        "  return_raw_chat: True\n\nactor_rollout_ref:\n  hybrid_engine: True\n  rollout:\n    name: sglang\n"
        "    multi_turn:\n      enable: True\n      max_assistant_turns: 2\n")
    train, test = write_math(tmp_path / "train.parquet"), write_math(tmp_path / "test.parquet")
    got = cli_in_process("train", "ppo", f"--config-path={tmp_path}", "--config-name=gsm8k_multiturn_grpo",
                         *grpo_math(str(tiny_model_dir), train, test), "trainer.total_training_steps=2",
                         f"actor_rollout_ref.rollout.multi_turn.tool_config_path={_yaml(tmp_path)}",
                         "trainer.test_freq=-1", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
                         f"trainer.output_dir={tmp_path / 'out'}", "trainer.logger=[console,jsonl]",
                         "trainer.progress_bar=false")
    assert got.returncode == 0, got.stderr[-3000:] + got.stdout[-3000:]
    rows = [json.loads(line) for line in
            next((tmp_path / "out").glob("*/logs/metrics.jsonl")).read_text().splitlines()]
    steps = [r for r in rows if "agent/turns" in r]
    # the tiny model never writes a tool call: every episode ends after its first turn, as verl's loop ends it
    assert [r["step"] for r in steps] == [1, 2] and all(r["agent/turns"] == 1.0 for r in steps), steps
