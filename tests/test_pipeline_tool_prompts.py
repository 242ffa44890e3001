"""The ZeroMQ sampler templates its prompts as the in-process loop does: with verl's tool schemas (cut to
data.max_prompt_length) and the run's chat-template variables (data.chat_template_kwargs). Same batches, same
seeds, so the same weights; a sampler templating otherwise would train other prompts."""

import shutil

import pytest
import torch

from alignrl.config import load_config
from alignrl.models.loader import load_tokenizer
from alignrl.runner import train_grpo
from alignrl.runtime.ports import free_ports
from test_verl_tool_prompts import TOOLS_TEMPLATE
from test_verl_tools import _yaml
from zmqpipeline import finish, overrides, sampler, spawn, weights

# a switch read from the run's variables: the prompt differs with and without it
VARIABLE = "{% if add_generation_prompt and mode is defined %}({{ mode }}) {% endif %}"


@pytest.mark.timeout(400)
def test_the_sampler_templates_with_the_schemas_and_the_variables_as_the_trainer_does(tiny_model_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    tok = load_tokenizer(folder)
    tok.chat_template = TOOLS_TEMPLATE + VARIABLE
    tok.save_pretrained(str(folder))
    ports, steps = free_ports(2), 2
    # prompts of 56-125 tokens, 120-189 with the schemas: cut in the middle to 100, they keep the schemas' start and
    # the variable's end
    extra = [f"agent.tool_config_path={_yaml(tmp_path)}", "agent.max_turns=2", "agent.max_response_length=16",
             "data.max_prompt_length=100", "data.truncation=middle", "data.chat_template_kwargs.mode=brief",
             "actor.entropy_coeff=0.01"]  # the tiny model earns no reward here: the entropy term's gradient reads
    # the prompts, so other prompts give other weights
    train_grpo(load_config(None, overrides(folder, tmp_path, "inline", steps, ports, *extra)))
    trainer = spawn("train", "grpo", *overrides(folder, tmp_path, "zmq", steps, ports, *extra,
                                                 "pipeline.placement=zmq", "pipeline.peer_timeout_s=120"))
    finish(trainer, sampler(folder, ports))
    a, b = weights(tmp_path / "inline", steps), weights(tmp_path / "zmq", steps)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
