"""data.chat_template_kwargs (verl's data.apply_chat_template_kwargs, e.g. Qwen3's enable_thinking): the run's
tokenizer renders its chat template with them wherever a prompt is templated, and nothing it saves changes."""

import copy
import json
import pickle
import shutil

import pytest

from alignrl.config import load_config
from alignrl.data.collate import prompt_ids
from alignrl.data.records import Sample
from alignrl.models.loader import load_tokenizer, with_template_variables

pytestmark = pytest.mark.timeout(240)

# Qwen3's switch as its template reads it: without enable_thinking=false the generation prompt is left open
THINKING = ("{%- if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
            "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")


@pytest.fixture
def thinking_model(tiny_model_dir, tmp_path):
    """A copy of the tiny model whose chat template ends with Qwen3's enable_thinking switch."""
    folder = tmp_path / "thinking"
    shutil.copytree(tiny_model_dir, folder)
    tok = load_tokenizer(folder)
    tok.chat_template = tok.chat_template + THINKING
    tok.save_pretrained(str(folder))
    return folder


def _text(tok, sample: Sample) -> str:
    return tok.decode(prompt_ids(tok, sample), skip_special_tokens=False)


@pytest.mark.parametrize("given, expect", [
    (["+data.apply_chat_template_kwargs.enable_thinking=False"], {"enable_thinking": False}),
    (["++data.apply_chat_template_kwargs.enable_thinking=true"], {"enable_thinking": True}),
    (["data.apply_chat_template_kwargs={enable_thinking: false, reasoning_effort: low}"],
     {"enable_thinking": False, "reasoning_effort": "low"}),
    (["data.chat_template_kwargs.enable_thinking=false"], {"enable_thinking": False}),
    ([], {}),
])
def test_verls_spelling_and_alignrls_reach_the_data_config(given, expect):
    assert load_config(None, given).data.chat_template_kwargs == expect


def test_a_value_that_is_not_a_mapping_is_one_line():
    from alignrl.config import ConfigError

    with pytest.raises(ConfigError, match="bad value for 'data.chat_template_kwargs'"):
        load_config(None, ["data.chat_template_kwargs=5"])


def test_the_tokenizer_renders_with_the_variables_and_saves_unchanged(thinking_model, tmp_path):
    tok = load_tokenizer(thinking_model)
    row = Sample([{"role": "user", "content": "2+3?"}], "5")
    assert "<think>" not in _text(tok, row)
    with_template_variables(tok, {"enable_thinking": False})
    assert _text(tok, row).endswith("<think>\n\n</think>\n\n")
    # a call that sets the variable itself wins; copies (Ray ships tokenizers by pickle) keep the variables
    assert "<think>" not in tok.apply_chat_template(row.messages, tokenize=False, add_generation_prompt=True,
                                                    enable_thinking=True)
    for other in (pickle.loads(pickle.dumps(tok)), copy.deepcopy(tok)):
        assert _text(other, row).endswith("</think>\n\n")
    tok.save_pretrained(str(tmp_path / "saved"))
    assert "enable_thinking" not in json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text()).get(
        "chat_template_kwargs", {})
    assert "<think>" not in _text(load_tokenizer(tmp_path / "saved"), row)  # the saved template is the model's own
    # set again (a sampler serving a restarted trainer): replaced; none: the template's own behaviour back
    with_template_variables(tok, {"enable_thinking": True})
    assert "<think>" not in _text(tok, row)
    with_template_variables(tok, {"enable_thinking": False})
    with_template_variables(tok, {})
    assert "<think>" not in _text(tok, row)


# a template whose prompts are long unless the run sets enable_thinking=false
LONG_UNLESS_SET = ("{%- if add_generation_prompt and not (enable_thinking is defined and enable_thinking is false) %}"
                   "{{- 'thinking ' * 400 }}{%- endif %}")


def test_a_run_templates_its_prompts_and_its_overlong_filter_with_the_variables(tiny_model_dir, tmp_path,
                                                                                cli_in_process):
    """The variables reach the filter of overlong prompts and the prompts the run trains on: with the template's
    long branch every prompt is over data.max_prompt_length, without it the run trains."""
    from conftest import SMALL_GRPO, run_settings

    folder = tmp_path / "long"
    shutil.copytree(tiny_model_dir, folder)
    tok = load_tokenizer(folder)
    tok.chat_template = tok.chat_template + LONG_UNLESS_SET
    tok.save_pretrained(str(folder))
    common = [*SMALL_GRPO, f"model.path={folder}", "data.filter_overlong_prompts=true", "data.max_prompt_length=128"]
    refused = cli_in_process("train", "grpo", *common, *run_settings(tmp_path / "out", "long", 1))
    assert refused.returncode != 0 and "data.max_prompt_length" in refused.stderr, refused.stderr[-2000:]
    got = cli_in_process("train", "grpo", *common, *run_settings(tmp_path / "out", "short", 1),
                         "+data.apply_chat_template_kwargs.enable_thinking=False")
    assert got.returncode == 0, got.stderr[-3000:] + got.stdout[-3000:]
    assert "dropped" not in got.stdout + got.stderr  # every prompt fit: templated with enable_thinking=false
