"""A producer (the ZeroMQ sampler, a Ray rollout worker) templates its prompts as the trainer does: with verl's tool
schemas, cut to data.max_prompt_length, and the run's chat-template variables (data.chat_template_kwargs)."""

import shutil

import pytest

from alignrl.config import load_config
from alignrl.data.collate import encode_prompts
from alignrl.models.loader import load_tokenizer, with_template_variables
from alignrl.placements.build import producer_prompts
from alignrl.placements.episodes import with_tools
from alignrl.rollout.verl_tools import tool_schemas
from scripted_engine import ScriptedEngine
from test_verl_tool_prompts import TOOLS_TEMPLATE
from test_verl_tools import _yaml

pytestmark = pytest.mark.timeout(240)

# a switch read from the run's variables: the prompt differs with and without it
VARIABLE = "{% if add_generation_prompt and mode is defined %}({{ mode }}) {% endif %}"


def test_a_producers_prompts_carry_the_schemas_and_the_variables_as_the_trainers_do(tiny_model_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    tok = load_tokenizer(folder)
    tok.chat_template = TOOLS_TEMPLATE + VARIABLE
    tok.save_pretrained(str(folder))
    # prompts of 56-125 tokens, 120-189 with the schemas: cut in the middle to 100, they keep the schemas' start and
    # the variable's end
    cfg = load_config(None, ["data.train_size=16", f"agent.tool_config_path={_yaml(tmp_path)}",
                             "data.max_prompt_length=100", "data.truncation=middle",
                             "data.chat_template_kwargs.mode=brief"])
    produced = load_tokenizer(folder)  # as a producer loads it: the model's own template, no variables yet
    train, rows = producer_prompts(cfg, produced)
    # the trainer's: its tokenizer bound at load (placements.local), its prompts encoded with the schemas (runner)
    trainer_tok = with_template_variables(load_tokenizer(folder), cfg.data.chat_template_kwargs)
    expect = encode_prompts(trainer_tok, train, 100, "middle", tool_schemas(cfg.agent.tool_config_path))
    got = [rows.prompt(i) for i in range(len(train))]
    assert [list(p) for p in got] == [list(p) for p in expect]
    text = produced.decode(got[0], skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\ncalc_gsm8k_reward: ") and text.endswith("assistant\n(brief) ")
    # the tool turns of the producer's episodes are rendered by the same tokenizer, variables bound
    env = with_tools(cfg, ScriptedEngine({}), produced)
    assert env.tokenizer is produced and produced.apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True).endswith("(brief) ")
