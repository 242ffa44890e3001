"""verl's tool schemas count in the prompt's length (agent.tool_config_path): the run's prompts are templated with
them, so data.filter_overlong_prompts measures them and data.max_prompt_length cuts them, as verl's dataset does;
the episode keeps that prompt (the engine reads those ids) rather than templating the row again, uncut."""

import asyncio
import copy
import shutil
import sys
import textwrap

import pytest

from alignrl.data import synthetic
from alignrl.data.collate import PromptTooLong, encode_prompts, prompt_ids, truncate
from alignrl.data.prompts import PromptData, drop_overlong
from alignrl.data.records import Sample
from alignrl.interfaces import SamplingParams
from alignrl.rollout.env_agent import EnvRollout, TaskPrompt
from alignrl.rollout.verl_tools import ToolConfigError, ToolLoop, tool_environment, tool_schemas
from conftest import SMALL_GRPO, one_line, run_settings
from scripted_engine import ScriptedEngine
from test_verl_tools import ECHO_TOOL, GSM8K_YAML, SCHEMA, _echo_yaml, _yaml

pytestmark = pytest.mark.timeout(240)

# the tiny model's template, with a system turn naming and describing the tools when it is given them (as Qwen's
# prints their JSON): the schemas' tokens are part of the prompt
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t['function']['name'] }}: "
                  "{{ t['function']['description'] }}\n{% endfor %}<|im_end|>\n{% endif %}"
                  "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tools_tok(tiny_model):
    tok = copy.deepcopy(tiny_model[1])
    tok.chat_template = TOOLS_TEMPLATE
    return tok


@pytest.fixture
def user_tools(tmp_path, monkeypatch):
    """The working folder holds `<module>.py` defining EchoTool (test_verl_tools' user tool); `<module>` returned."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    monkeypatch.chdir(tmp_path)
    module = f"prompt_tools_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{module}.py").write_text(ECHO_TOOL)
    return module


def _lengths(tok, rows, tools=None):
    return [len(prompt_ids(tok, s, tools)) for s in rows]


def _between(tok, rows, tools):
    """A limit every prompt fits without the schemas, and about half of them with."""
    with_tools = sorted(_lengths(tok, rows, tools))
    limit = with_tools[len(with_tools) // 2]
    assert max(_lengths(tok, rows)) <= limit < with_tools[-1]
    return limit


def test_tool_schemas_are_the_environments_read_without_making_the_tools(tiny_model, tmp_path, user_tools):
    tok = tiny_model[1]
    for path in (_yaml(tmp_path), _echo_yaml(tmp_path, user_tools)):
        env = asyncio.run(tool_environment(path, tok, ToolLoop())())
        assert tool_schemas(path) == env.chat.schemas  # one dump: what the prompts are cut with is what they show
    assert tool_schemas(_yaml(tmp_path))[0]["function"]["name"] == "calc_gsm8k_reward"
    # a tool that cannot be made (here: its constructor raises; the search tool asks its server) still gives its
    # schema: the prompts are measured before any tool is made
    (tmp_path / f"{user_tools}_broken.py").write_text(ECHO_TOOL + textwrap.dedent("""
        class Broken(EchoTool):
            def __init__(self, config, tool_schema):
                raise RuntimeError("contacted a server")
        """))
    broken = _yaml(tmp_path, f'tools:\n  - class_name: "{user_tools}_broken.Broken"\n    config: {{type: native}}' +
                   SCHEMA.format(name="b"), "broken.yaml")
    assert tool_schemas(broken)[0]["function"]["name"] == "b"
    with pytest.raises(ToolConfigError, match="raised RuntimeError: contacted a server"):
        asyncio.run(tool_environment(broken, tok, ToolLoop())())
    # an entry without a tool_schema takes its class's (verl's BaseTool): that tool alone is made for it
    (tmp_path / f"{user_tools}_own.py").write_text(ECHO_TOOL + textwrap.dedent("""
        class Own(EchoTool):
            def get_openai_tool_schema(self):
                return OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {
                    "name": "own", "description": "d", "parameters": {"type": "object", "properties": {},
                    "required": []}}})
        """))
    own = _yaml(tmp_path, f'tools:\n  - class_name: "{user_tools}_own.Own"\n    config: {{type: native}}\n', "own.yaml")
    assert tool_schemas(own) == asyncio.run(tool_environment(own, tok, ToolLoop())()).chat.schemas
    assert tool_schemas(own)[0]["function"]["name"] == "own"


@pytest.mark.parametrize("text, expect", [
    ("tools: []\n", "has no 'tools' list"),
    ("tools:\n  - config: {}\n", "tools[0] has no class_name"),
    ('tools:\n  - class_name: "a.B"\n    config: {type: mcp}\n', "is not supported"),
    ('tools:\n  - class_name: "a.B"\n    tool_schema: {type: function, function: {description: d}}\n',
     "function.name: Field required"),
    (GSM8K_YAML + GSM8K_YAML.split("tools:\n")[1], "tool name 'calc_gsm8k_reward' is given twice"),
])
def test_tool_schemas_refuses_a_bad_config_in_one_line(tmp_path, text, expect):
    with pytest.raises(ToolConfigError) as err:
        tool_schemas(_yaml(tmp_path, text))
    assert expect in one_line(str(err.value)) and "agent.tool_config_path" in str(err.value)


def test_the_schemas_count_in_the_overlong_filter_and_the_cut(tools_tok, tmp_path):
    tools = tool_schemas(_yaml(tmp_path))
    rows = synthetic.generate("train", 16, seed=0)
    limit = _between(tools_tok, rows, tools)
    over = [s for s, n in zip(rows, _lengths(tools_tok, rows, tools)) if n > limit]
    # every prompt fits without the schemas; with them, the longer ones are filtered (data.filter_overlong_prompts)
    assert drop_overlong(rows, tools_tok, limit, "training") == rows
    kept = drop_overlong(rows, tools_tok, limit, "training", tools)
    assert kept == [s for s in rows if s not in over] and over
    # ... or cut to the limit with them (data.truncation), the schemas' tokens kept at the front with "right"
    full = prompt_ids(tools_tok, over[0], tools)
    assert PromptData(tools_tok, over, limit, "left", tools).prompt(0) == full[-limit:]
    assert encode_prompts(tools_tok, over[:1], limit, "right", tools) == [full[:limit]]
    assert encode_prompts(tools_tok, over[:1], limit) == [prompt_ids(tools_tok, over[0])]  # without: not cut
    with pytest.raises(PromptTooLong, match=f"over data.max_prompt_length={limit}"):
        encode_prompts(tools_tok, over[:1], limit, "error", tools)


def test_without_tools_the_template_is_called_as_before(tools_tok):
    """Every caller that passes no tools (runs without agent.tool_config_path) templates the prompt as before: no
    `tools` argument reaches apply_chat_template."""
    seen = []

    class Spy:
        def apply_chat_template(self, messages, **kwargs):
            seen.append(kwargs)
            return tools_tok.apply_chat_template(messages, **kwargs)

    row = synthetic.generate("train", 1, seed=0)[0]
    assert prompt_ids(Spy(), row) == prompt_ids(tools_tok, row)
    assert seen == [{"add_generation_prompt": True, "tokenize": True}]


def test_the_episode_keeps_the_cut_prompt_with_the_schemas_and_the_engine_reads_it(tools_tok, tiny_model, tmp_path):
    path = _yaml(tmp_path)
    tools = tool_schemas(path)
    rows = synthetic.generate("train", 16, seed=0)
    limit = _between(tools_tok, rows, tools)
    long, short = (next(s for s, n in zip(rows, _lengths(tools_tok, rows, tools)) if test(n))
                   for test in (lambda n: n > limit, lambda n: n <= limit))
    data = PromptData(tools_tok, [long, short], limit, "left", tools)
    prompts = [TaskPrompt(data.prompt(i), s) for i, s in enumerate((long, short))]
    assert list(prompts[0]) == prompt_ids(tools_tok, long, tools)[-limit:]
    assert list(prompts[1]) == prompt_ids(tools_tok, short, tools)  # the schemas' system turn and the question
    engine = ScriptedEngine({tuple(p): [tools_tok.encode(" #### 1", add_special_tokens=False)] for p in prompts},
                            key=tuple)
    ro = EnvRollout(engine, tools_tok, tool_environment(path, tools_tok, ToolLoop()), response_cap=20).generate(
        prompts, SamplingParams(max_new_tokens=10))
    assert engine.calls[0][0] == [list(p) for p in prompts]  # the cut prompt, not the row templated again, uncut
    assert [ro.prompt_ids[i][ro.prompt_mask[i]].tolist() for i in range(2)] == [list(p) for p in prompts]
    # the tiny model's template prints no tools: its prompts are the same with or without them, and kept too
    tok = tiny_model[1]
    plain = [TaskPrompt(prompt_ids(tok, s, tools), s) for s in (long, short)]
    assert list(plain[0]) == prompt_ids(tok, long)
    engine = ScriptedEngine({tuple(p): [tok.encode(" #### 1", add_special_tokens=False)] for p in plain}, key=tuple)
    EnvRollout(engine, tok, tool_environment(path, tok, ToolLoop()), response_cap=20).generate(
        plain, SamplingParams(max_new_tokens=10))
    assert engine.calls[0][0] == [list(p) for p in plain]


def test_a_prompt_templated_without_the_schemas_gets_them(tools_tok, tmp_path):
    """A caller that did not pass the schemas (a sampler templating its prompts alone) still shows them to the
    policy: the row is templated again with them, as before they counted in the prompt's length."""
    path = _yaml(tmp_path)
    row = Sample([{"role": "user", "content": "q"}], "1")
    env = asyncio.run(tool_environment(path, tools_tok, ToolLoop())())
    bare = tools_tok.decode(prompt_ids(tools_tok, row))
    got = asyncio.run(env.reset({"observation": bare, "label": "1", "sample": row}))["observation"]
    assert got == tools_tok.decode(prompt_ids(tools_tok, row, tool_schemas(path)))
    assert got.startswith("<|im_start|>system\ncalc_gsm8k_reward: A tool for calculating") and got.endswith(bare)


@pytest.mark.parametrize("filtered", [True, False])
def test_a_run_with_the_tool_loop_filters_or_cuts_its_prompts_with_the_schemas(tiny_model_dir, tiny_model, tools_tok,
                                                                               tmp_path, cli_in_process, monkeypatch,
                                                                               filtered):
    """Two GRPO steps in verl's tool loop on a model whose template prints the tools: the training and held-out
    prompts the episodes start from are the rows templated with the schemas; data.filter_overlong_prompts drops the
    rows that only the schemas put over data.max_prompt_length, or (without it) they are cut to it."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    path = _yaml(tmp_path)
    tools = tool_schemas(path)
    train, val = synthetic.generate("train", 32, seed=0), synthetic.generate("test", 8, seed=0)
    limit = _between(tools_tok, train, tools)
    assert min(_lengths(tools_tok, val, tools)) <= limit
    seen = []
    generate = EnvRollout.generate

    def recording(self, prompts, params):
        seen.extend((list(p), p.sample) for p in prompts)
        return generate(self, prompts, params)

    monkeypatch.setattr(EnvRollout, "generate", recording)
    got = cli_in_process("train", "grpo", *SMALL_GRPO, f"model.path={model}", *run_settings(tmp_path / "out", "t", 2),
                         f"agent.tool_config_path={path}", "agent.max_turns=2", "agent.max_response_length=40",
                         "data.val_size=8", f"data.max_prompt_length={limit}",
                         f"data.filter_overlong_prompts={str(filtered).lower()}")
    assert got.returncode == 0, got.stderr[-3000:] + got.stdout[-3000:]
    over = sum(n > limit for n in _lengths(tools_tok, train, tools))
    assert (f"dropped {over} of 32 training prompts" in got.stdout) is filtered
    assert any(s in val for _, s in seen) and any(s in train for _, s in seen)  # held-out and training prompts
    for ids, sample in seen:
        assert ids == truncate(prompt_ids(tools_tok, sample, tools), limit)
    cut = [ids for ids, s in seen if len(prompt_ids(tools_tok, s, tools)) > limit]
    assert not cut if filtered else cut and all(len(ids) == limit for ids in cut)
