"""TRL's YAML config file (`--config grpo.yaml`) on `alignrl train grpo`: its keys are TRL's flags, the line's flags
win over it, `env` is set, and anything else is one line."""

import json
import os

import pytest

from alignrl.cli import _in_alignrl_words
from alignrl.compat.trl_config_file import expand
from alignrl.config import ConfigError
from alignrl.compat.trl_grpo_keys import from_line
from alignrl.config import load_config

RECIPE = """
model_name_or_path: demo
dataset_name: {data}
reward_funcs:
- accuracy_reward
- think_format_reward
reward_weights: [1.0, 0.5]
learning_rate: 2.0e-05
num_generations: 4
per_device_train_batch_size: 8
max_steps: 6
bf16: false
gradient_checkpointing: true
report_to: [none]
output_dir: {out}
env:
  ALIGNRL_TEST_FROM_RECIPE: "yes"
"""


def _config(words):
    translated, _ = from_line(words)
    return load_config(None, [w for w in translated if "=" in w])


def _recipe(tmp_path, text=RECIPE):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "What is 1+1?", "solution": "2"}) + "\n")
    path = tmp_path / "grpo.yaml"
    path.write_text(text.format(data=data, out=tmp_path / "out"))
    return path, data


def test_a_trl_recipe_reads_as_its_flags_and_the_line_wins(tmp_path, monkeypatch):
    monkeypatch.delenv("ALIGNRL_TEST_FROM_RECIPE", raising=False)
    path, data = _recipe(tmp_path)
    words = expand(["--config", str(path), "--learning_rate", "1e-6"])
    assert os.environ["ALIGNRL_TEST_FROM_RECIPE"] == "yes"
    cfg = _config(words)
    flags = _config(["--model_name_or_path", "demo", "--dataset_name", str(data), "--reward_funcs", "accuracy_reward",
                     "think_format_reward", "--reward_weights", "1.0", "0.5", "--num_generations", "4",
                     "--per_device_train_batch_size", "8", "--max_steps", "6", "--bf16", "false",
                     "--gradient_checkpointing", "--report_to", "none", "--output_dir", str(tmp_path / "out"),
                     "--learning_rate", "1e-6"])
    assert cfg == flags
    assert cfg.actor.lr == 1e-6 and cfg.rollout.n == 4
    assert cfg.algorithm.reward_fn == "trl:accuracy_reward;think_format_reward@0.5"
    # the CLI takes a line naming only the file as TRL's
    routed = _in_alignrl_words(["train", "grpo", f"--config={path}"])
    assert "rollout.n=4" in routed and "actor.lr=2e-05" in routed


def test_other_yaml_files_stay_where_they_are_and_bad_recipes_are_one_line(tmp_path):
    alignrl_yaml = tmp_path / "run.yaml"
    alignrl_yaml.write_text("actor:\n  lr: 1.0e-5\n")
    assert expand(["--config", str(alignrl_yaml)]) is None
    assert _in_alignrl_words(["train", "grpo", "--config", str(alignrl_yaml)]) == \
        ["train", "grpo", "--config", str(alignrl_yaml)]
    path, _ = _recipe(tmp_path, RECIPE + "hub_strategy: every_save\nsystem_prompt: be brief\n")
    with pytest.raises(ConfigError, match=r"hub_strategy, system_prompt are not among TRL's GRPO flags alignrl "
                                           r"reads; remove them from the file$"):
        expand(["--config", str(path)])
    broken = tmp_path / "broken.yaml"
    broken.write_text("model_name_or_path: demo\nnum_generations: [4\n")
    with pytest.raises(ConfigError, match=r"--config .*broken.yaml: not valid YAML at line 3"):
        expand(["--config", str(broken)])


def test_a_trl_sft_recipe_reads_as_its_flags_and_a_flat_alignrl_config_stays(tmp_path):
    from alignrl.preference.cli import _with_their_config_file
    from alignrl.preference.sft_cli import parse_sft

    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"prompt": "Hi", "completion": "Hello"}) + "\n")
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(f"model_name_or_path: demo\ndataset_name: {data}\nlearning_rate: 2.0e-05\nnum_train_epochs: 2\n"
                      f"per_device_train_batch_size: 4\ngradient_checkpointing: false\noutput_dir: {tmp_path / 'o'}\n")
    line, read = _with_their_config_file(["--config", str(recipe), "--num_train_epochs", "1"])
    assert read == str(recipe)
    flags = ["--model_name_or_path", "demo", "--dataset_name", str(data), "--learning_rate", "2e-05",
             "--num_train_epochs", "2", "--per_device_train_batch_size", "4", "--gradient_checkpointing", "false",
             "--output_dir", str(tmp_path / "o"), "--num_train_epochs", "1"]
    assert parse_sft(line) == parse_sft(flags)
    assert parse_sft(line).epochs == 1 and parse_sft(line).learning_rate == 2e-05
    flat = tmp_path / "flat.yaml"
    flat.write_text(f"model_path: demo\ntrain_files: [{data}]\nlearning_rate: 1.0e-05\n")
    assert _with_their_config_file(["--config", str(flat)]) == (["--config", str(flat)], None)


def test_a_seed_config_stays_the_seed_s_and_file_mistakes_name_the_file(tmp_path):
    """Safe-MM-DPO's configs share max_grad_norm with TRL's names: they stay alignrl's flat configs, and their bad
    YAML is told by their own reader. A TRL recipe's null, a missing recipe and a bad value each name the file."""
    from pathlib import Path

    from alignrl.preference.cli import _with_their_config_file

    import dataclasses

    from alignrl.preference.cli import trl_only_names
    from alignrl.preference.kto_cli import KTOConfig
    from alignrl.preference.sft_cli import SFTConfig

    # no flat key of sft or kto is one of the names that make a file TRL's
    assert not trl_only_names() & {f.name for c in (KTOConfig, SFTConfig) for f in dataclasses.fields(c)}
    assert {"model_name_or_path", "dataset_name"} <= trl_only_names()
    seed = Path(__file__).parent / "fixtures" / "mmdpo" / "dpo_config.yaml"
    assert _with_their_config_file(["--config", str(seed)]) == (["--config", str(seed)], None)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_name_or_path: demo\nw: [1\n")
    assert _with_their_config_file(["--config", str(bad)]) == (["--config", str(bad)], None)
    path, _ = _recipe(tmp_path, RECIPE + "max_prompt_length: null\nmin_p: null\nepsilon_high: null\n")
    with pytest.raises(ConfigError, match=r"max_prompt_length has no value \(null or \[\]\), which alignrl cannot "
                                          r"take for it; give a value or remove the key"):
        expand(["--config", str(path)])  # TRL's None is no truncation there: a value alignrl has no flag value for
    path, _ = _recipe(tmp_path, RECIPE + "min_p: null\nepsilon_high: null\n")  # flags whose default is None: theirs
    assert _config(expand(["--config", str(path)])) == _config(expand(["--config", str(_recipe(tmp_path)[0])]))
    with pytest.raises(ConfigError, match=r"--config nowhere.yaml: no such file"):
        expand(["--model_name_or_path", "demo", "--config", "nowhere.yaml"])
    path, _ = _recipe(tmp_path, RECIPE + "scale_rewards: mean\n")
    with pytest.raises(ConfigError, match=r"--scale_rewards mean: .*; the settings of --config .*grpo.yaml are read "):
        _in_alignrl_words(["train", "grpo", "--config", str(path)])
    with pytest.raises(ConfigError, match=r"--scale_rewards mean: .*; the settings of --config .*grpo.yaml are read "):
        _in_alignrl_words(["train", "--config", str(path), "grpo"])  # the file before the word: read as TRL's too
    # a Hydra config named grpo is the value of -cn, not the algorithm: the line stays as it is
    assert _in_alignrl_words(["train", "-cn", "grpo", "-cp", "conf", "ppo"]) == ["train", "-cn", "grpo", "-cp", "conf",
                                                                                  "ppo"]
