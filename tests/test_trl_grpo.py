"""`alignrl train grpo` in TRL's spelling (`trl grpo` flags) and TRL's reward functions."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from alignrl.compat.trl_grpo_flags import TrlFlagError, is_trl_line
from alignrl.compat.trl_grpo_keys import from_line
from alignrl.config import ConfigError, load_config
from alignrl.rewards.errors import RewardError, ScoreError
from alignrl.rewards.registry import import_file, load_reward_fn

from conftest import one_line

REWARD_FILE = '''
import json, os

def match(completions, solution, prompts=None, **kwargs):
    with open(os.environ["SEEN_FILE"], "a") as f:
        f.write(json.dumps({"solution": solution, "prompts": prompts, "completions": completions,
                            "kwargs": sorted(kwargs)}) + "\\n")
    return [1.0 if s in (c if isinstance(c, str) else c[0]["content"]) else 0.0 for c, s in zip(completions, solution)]

def half(completions, **kwargs):
    return [0.5 for _ in completions]

def skip(completions, **kwargs):
    return [None for _ in completions]

def broken(completions, **kwargs):
    raise ValueError("no answer column")

def two(completions, **kwargs):
    return [1.0, 2.0]

def nan(completions, **kwargs):
    return [float("nan") for _ in completions]

async def later(completions, log_metric=None, log_extra=None, **kwargs):
    log_metric("m", 1.0), log_extra("e", ["x"])
    return [0.75 for _ in completions]
'''


def _config(argv: list[str], world: int | None = None):
    words, lines = from_line(argv + (["--nproc", str(world)] if world else []))
    overrides = [w for w in words if "=" in w]
    return load_config(None, overrides), lines


def _data(tmp_path: Path, rows: int = 8) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i}+1?"}],
                                        "solution": str(i + 1), "level": i % 3}) + "\n" for i in range(rows)))
    return path


def test_trl_lines_are_told_apart_from_alignrl_lines():
    assert is_trl_line(["--model_name_or_path", "m", "--dataset_name", "d"])
    assert is_trl_line(["--num_generations=4"])
    assert not is_trl_line(["actor.lr=1e-5", "rollout.n=8", "--config", "x.yaml"])


def test_trl_batches_and_defaults_become_alignrl_keys(tmp_path):
    data = _data(tmp_path)
    cfg, lines = _config(["--model_name_or_path", "demo", "--dataset_name", str(data), "--reward_funcs",
                          "accuracy_reward", "--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size",
                          "4", "--gradient_accumulation_steps", "4", "--num_iterations", "2", "--max_steps", "10",
                          "--epsilon_high", "0.28", "--beta", "0.04", "--loss_type", "dr_grpo", "--warmup_ratio",
                          "0.1", "--scale_rewards", "none", "--top_k", "0"], world=2)
    # 4 x 2 ranks x 4 accumulation = 32 completions an optimizer step; a round of 32 = 4 prompts x 8, trained twice
    assert (cfg.data.train_batch_size, cfg.rollout.n, cfg.actor.ppo_mini_batch_size) == (4, 8, 4)
    assert (cfg.actor.ppo_mini_batch_unit, cfg.actor.ppo_micro_batch_size, cfg.actor.ppo_epochs) == ("prompts", 4, 2)
    assert cfg.trainer.total_training_steps == 5  # 10 optimizer steps / 2 a round
    assert cfg.actor.lr_warmup_steps == 1  # ceil(0.1 x 10)
    assert (cfg.actor.lr, cfg.actor.lr_scheduler, cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == \
        (1e-6, "linear", 0.2, 0.28)
    assert cfg.actor.use_kl_loss and cfg.actor.kl_loss_coef == 0.04 and cfg.actor.kl_loss_type == "k3"
    assert cfg.actor.loss_agg_mode == "seq-mean-token-sum-norm" and not cfg.algorithm.norm_adv_by_std_in_grpo
    assert (cfg.rollout.max_new_tokens, cfg.data.max_prompt_length, cfg.rollout.top_k) == (256, 512, -1)
    assert cfg.data.prompt_key == "prompt" and cfg.data.train_files == str(data)
    assert cfg.algorithm.reward_fn == "trl:accuracy_reward" and cfg.trainer.seed == 42
    assert cfg.trainer.output_dir == str(tmp_path) and cfg.trainer.experiment_name == "out"
    defaults, batches = lines[:2]
    assert "TRL's defaults taken: " in defaults and "learning_rate 1e-06" in defaults and "num_generations 8" in \
        defaults and ", beta " not in defaults and "num_train_epochs" not in defaults and "not taken: logging_steps 10" in defaults
    assert "= 32 completions per optimizer step" in batches and "data.train_batch_size=4" in batches
    # TRL cuts no prompt: alignrl's own cap leaves longer ones out, and says so instead of calling it TRL's default
    assert cfg.data.filter_overlong_prompts and "max_prompt_length" not in defaults
    assert lines[2].startswith("--max_prompt_length 512 (default): alignrl's own cap (TRL's GRPOConfig has none")


def test_trl_loss_variants_and_a_round_that_cuts_groups(tmp_path):
    base = ["--dataset_name", str(_data(tmp_path)), "--reward_funcs", "think_format_reward", "--max_steps", "3"]
    gspo, _ = _config(base + ["--importance_sampling_level", "sequence", "--mask_truncated_completions",
                              "--loss_type", "grpo"])
    assert gspo.actor.policy_loss == "gspo" and gspo.algorithm.mask_truncated and not gspo.actor.use_kl_loss
    assert gspo.actor.loss_agg_mode == "seq-mean-token-mean"
    with pytest.raises(TrlFlagError, match="sequence with --loss_type dapo: alignrl's GSPO averages the completions"):
        _config(base + ["--importance_sampling_level", "sequence"])  # TRL weighs dapo's sequences by length
    batch, _ = _config(base + ["--scale_rewards", "batch"])
    assert batch.algorithm.norm_adv_by_std_in_grpo and batch.algorithm.grpo_std_scope == "batch"
    assert gspo.algorithm.grpo_std_scope == "group"
    assert (gspo.actor.clip_ratio_delta, gspo.actor.kl_loss_ratio_weighted, gspo.actor.top_entropy_quantile) == \
        (None, False, 1.0)  # TRL's defaults: off
    opts, _ = _config(base + ["--delta", "1.5", "--beta", "0.01", "--use_bias_correction_kl", "--top_entropy_quantile",
                              "0.2", "--epsilon_high", "0.28"])
    assert (opts.actor.clip_ratio_delta, opts.actor.kl_loss_ratio_weighted, opts.actor.top_entropy_quantile) == \
        (1.5, True, 0.2)
    with pytest.raises(ConfigError, match=r"clip_ratio_delta=1.2 must be above 1 \+ actor.clip_ratio_high \(1.28\)"):
        _config(base + ["--delta", "1.2", "--epsilon_high", "0.28"])
    cispo, _ = _config(base + ["--loss_type", "cispo", "--epsilon_high", "5.0"])
    assert (cispo.actor.policy_loss, cispo.actor.clip_ratio_low, cispo.actor.clip_ratio_high) == ("cispo", 1.0, 4.0)
    # 6 completions an optimizer step hold no whole groups of 4: the mini-batch counts sequences; 2 steps a round
    cut, lines = _config(base + ["--per_device_train_batch_size", "6", "--steps_per_generation", "2",
                                 "--num_generations", "4"])
    assert (cut.data.train_batch_size, cut.actor.ppo_mini_batch_size, cut.actor.ppo_mini_batch_unit) == \
        (3, 6, "sequences")
    assert cut.trainer.total_training_steps == 2 and "2 optimizer step(s) of 6 sequences" in lines[1]
    # rounds of 2 generated four times between two optimizer steps share the weights: one round of 8
    joined, _ = _config(base + ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4",
                                "--steps_per_generation", "1", "--num_generations", "4"])
    assert (joined.data.train_batch_size, joined.actor.ppo_mini_batch_size, joined.trainer.total_training_steps) == \
        (2, 2, 3)
    # TRL runs one group of 8 per optimizer step over 2 ranks: the mini-batch counts its 8 sequences
    shared, _ = _config(base + ["--per_device_train_batch_size", "4", "--steps_per_generation", "4",
                                "--num_generations", "8"], world=2)
    assert (shared.data.train_batch_size, shared.actor.ppo_mini_batch_size, shared.actor.ppo_mini_batch_unit) == \
        (4, 8, "sequences")


def test_trl_luspo_vespo_and_the_off_policy_mask_become_alignrl_keys(tmp_path):
    base = ["--dataset_name", str(_data(tmp_path)), "--reward_funcs", "think_format_reward", "--max_steps", "3"]
    luspo, _ = _config(base + ["--loss_type", "luspo", "--importance_sampling_level", "sequence", "--delta", "1.5",
                               "--off_policy_mask_threshold", "0.5"])
    assert (luspo.actor.policy_loss, luspo.actor.loss_agg_mode, luspo.actor.clip_ratio_delta) == \
        ("luspo", "seq-mean-token-sum", 1.5)
    assert luspo.actor.off_policy_mask_threshold == 0.5 and not luspo.actor.use_kl_loss
    vespo, lines = _config(base + ["--loss_type", "vespo", "--vespo_k_pos", "1.5", "--vespo_lambda_neg", "2.5",
                                   "--beta", "0.04"])
    a = vespo.actor
    assert (a.policy_loss, a.loss_agg_mode, a.vespo_k_pos, a.vespo_lambda_pos, a.vespo_k_neg, a.vespo_lambda_neg) == \
        ("vespo", "token-mean", 1.5, 3.0, 3.0, 2.5)
    assert a.use_kl_loss and a.off_policy_mask_threshold is None  # TRL's default: no mask
    assert "vespo_lambda_pos 3.0" in lines[0] and "vespo_k_pos" not in lines[0]  # the defaults taken, said
    assert "vespo_" not in from_line(base)[1][0]
    # vespo reads the token log-ratios at either level (TRL warns and computes the same)
    assert "actor.policy_loss=vespo" in from_line(base + ["--loss_type", "vespo", "--importance_sampling_level",
                                                          "sequence"])[0]


def test_trl_generation_kwargs_override_the_sampling_flags(tmp_path):
    base = ["--dataset_name", str(_data(tmp_path)), "--reward_funcs", "think_format_reward", "--max_steps", "3",
            "--temperature", "0.9", "--min_p", "0.1"]
    cfg, _ = _config(base + ["--generation_kwargs", json.dumps({"stop_strings": ["</answer>", "\n\n"], "top_k": 0,
                                                                "min_p": 0.05, "max_tokens": 12})])
    r = cfg.rollout
    assert (r.stop, r.top_k, r.min_p, r.max_new_tokens, r.temperature) == (["</answer>", "\n\n"], -1, 0.05, 12, 0.9)
    odd, _ = _config(base + ["--generation_kwargs", json.dumps({"stop": ["😀", "${x}"]})])
    assert odd.rollout.stop == ["😀", "${x}"]  # text the override's YAML and OmegaConf would otherwise misread
    with pytest.raises(TrlFlagError, match=r"^--generation_kwargs num_beams, suppress_tokens: alignrl's engines take "
                                           r"only temperature, .*; drop the others$"):
        from_line(base + ["--generation_kwargs", '{"num_beams": 2, "suppress_tokens": [1]}'])
    with pytest.raises(TrlFlagError, match=r"^--generation_kwargs top_p=1.5: give a number in \(0, 1\]$"):
        from_line(base + ["--generation_kwargs", '{"top_p": 1.5}'])
    with pytest.raises(TrlFlagError, match=r"^--generation_kwargs 'top_p: 1' is not JSON"):
        from_line(base + ["--generation_kwargs", "top_p: 1"])


def test_string_prompts_are_read_as_written_as_trl_reads_them(tmp_path):
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"prompt": f"Q: {i}+1 =", "solution": str(i + 1)}) + "\n" for i in range(8)))
    line = ["--reward_funcs", "accuracy_reward", "--dataset_name"]
    cfg, lines = _config([*line, str(plain)])
    assert not cfg.data.apply_chat_template and cfg.data.prompt_key == "prompt"
    assert any(x.startswith(f"{plain}: its prompts are strings, read as written") for x in lines)
    cfg, lines = _config([*line, str(_data(tmp_path))])  # chat messages: templated
    assert cfg.data.apply_chat_template and not any("read as written" in x for x in lines)
    stored = tmp_path / "stored.jsonl"  # messages stored as a JSON string (LMM-R1's rows) are messages too
    stored.write_text(json.dumps({"prompt": json.dumps([{"role": "user", "content": "Q"}]), "solution": "1"}) + "\n")
    assert _config([*line, str(stored)])[0].data.apply_chat_template


def test_trl_lora_flags_and_the_comma_of_trls_usage_lines(tmp_path):
    base = ["--dataset_name", str(_data(tmp_path)), "--reward_funcs", "think_format_reward", "--use_peft",
            "--lora_r", "8", "--lora_alpha", "16"]
    cfg, _ = _config(base + ["--lora_target_modules", "q_proj,", "v_proj"])  # `"q_proj", "v_proj"` in a shell
    assert (cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.target_modules) == (8, 16, ["q_proj", "v_proj"])
    # none named: PEFT's own targets for the architecture, as TRL leaves LoraConfig's target_modules None
    assert _config(base)[0].model.target_modules == "peft-default"


def test_peft_default_targets_are_peft_choice_for_the_architecture(tiny_model):
    import copy

    from alignrl.models.folder import ModelError
    from alignrl.models.lora import add_adapters, lora_spec

    assert lora_spec(4, 8, 0.0, ["peft-default"]).target_modules == "peft-default"  # OpenRLHF's list spelling
    wrapped = add_adapters(copy.deepcopy(tiny_model[0]), lora_spec(4, 8, 0.0, "peft-default"))
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in wrapped.named_parameters() if "lora_A" in n}
    assert adapted == {"q_proj", "v_proj"}  # PEFT's mapping for qwen2
    other = copy.deepcopy(tiny_model[0])
    other.config.model_type = "no_such_type"
    with pytest.raises(ModelError, match="PEFT has no default targets for model type 'no_such_type'"):
        add_adapters(other, lora_spec(4, 8, 0.0, "peft-default"))


def test_trl_soft_overlong_punishment_keeps_trl_numbers(tmp_path):
    import torch

    from alignrl.core.shaping import overlong_penalty

    def trl(length: int, weight: float) -> float:  # TRL's script's get_soft_overlong_punishment(1280, 256), weighted
        return weight * (0.0 if length <= 1024 else (1024 - length) / 256 if length <= 1280 else -1.0)

    base = ["--dataset_name", str(_data(tmp_path)), "--max_steps", "1", "--reward_funcs", "think_format_reward",
            "get_soft_overlong_punishment", "--reward_weights", "1", "0.5"]
    cfg, lines = _config(base + ["--max_completion_length", "1100"])
    a = cfg.algorithm
    lengths = torch.tensor([10, 1024, 1050, 1100])
    assert overlong_penalty(lengths, 1100, a.overlong_buffer_len, a.overlong_penalty_factor).tolist() == \
        pytest.approx([trl(n, 0.5) for n in lengths.tolist()])
    default, lines = _config(base)  # 256 tokens never reach TRL's punishment
    assert default.algorithm.overlong_buffer_len == 0 and "never reaches it: no penalty" in lines[-1]
    with pytest.raises(TrlFlagError, match="-1 past 1280 tokens"):
        _config(base + ["--max_completion_length", "2048"])
    with pytest.raises(TrlFlagError, match="get_soft_overlong_punishment alone"):
        _config(base[:4] + ["--reward_funcs", "get_soft_overlong_punishment"])


def test_trl_eval_and_save_cadence_follow_transformers(tmp_path):
    base = ["--dataset_name", str(_data(tmp_path)), "--reward_funcs", "think_format_reward", "--max_steps", "40"]
    # one optimizer step a round: RL steps are optimizer steps; --eval_steps defaults to --logging_steps (10)
    cfg, _ = _config(base + ["--eval_strategy", "steps"])
    assert cfg.trainer.test_freq == 10
    cfg, lines = _config(base + ["--eval_strategy", "steps", "--logging_steps", "5"])
    assert cfg.trainer.test_freq == 5 and "--logging_steps" not in lines[-1]
    cfg, _ = _config(base + ["--eval_strategy", "steps", "--eval_steps", "0.25", "--save_steps", "0.5"])
    assert (cfg.trainer.test_freq, cfg.trainer.save_freq) == (10, 20)  # shares of the 40 steps, as transformers
    with pytest.raises(TrlFlagError, match="--save_steps 0.5: a share of the run's steps needs --max_steps"):
        _config(base[:4] + ["--save_steps", "0.5"])
    cfg, lines = _config(base + ["--eval_strategy", "epoch"])
    assert cfg.trainer.test_freq == 0 and any(line.startswith("--eval_strategy epoch: alignrl") for line in lines)
    _, lines = _config(base + ["--dataset_test_split", "validation"])  # a local file has no splits
    assert any(line.startswith("--dataset_test_split: ") and "change nothing" in line for line in lines)


@pytest.mark.parametrize("argv, words", [
    (["--num_generations", "3"], "must be a multiple of --num_generations 3"),
    (["--loss_type", "simpo"], "--loss_type simpo: alignrl has grpo"),
    (["--loss_type", "luspo"], "luspo with --importance_sampling_level token: TRL then averages"),
    (["--loss_type", "luspo", "--importance_sampling_level", "sequence", "--beta", "0.04"],
     "luspo with --beta above 0: TRL then weighs each completion's KL by its length"),
    (["--loss_type", "luspo", "--importance_sampling_level", "sequence", "--top_entropy_quantile", "0.2"],
     "luspo with --top_entropy_quantile"),
    (["--delta", "2", "--loss_type", "vespo"], "TRL leaves vespo's alone"),
    (["--scale_rewards", "mean"], "--scale_rewards mean: alignrl's GRPO scales by the group's std (group), the "
                                  "whole batch's (batch)"),
    (["--reward_weights", "1", "2"], "--reward_weights gives 2 weight(s) for 1 reward function(s)"),
    (["--delta", "2", "--loss_type", "cispo", "--epsilon_high", "5"], "--delta caps the ratio of --loss_type grpo"),
    (["--use_bias_correction_kl"], "which --beta 0.0 leaves out"),
    (["--use_bias_correction_kl", "--beta", "0.1", "--importance_sampling_level", "sequence", "--loss_type", "grpo"],
     "TRL weighs the KL by the sequence's ratio"),
    (["--no_such_flag", "1"], "'--no_such_flag' is not one of TRL's GRPO flags"),
    (["--no_such_flag", "-1"], "'--no_such_flag' is not one of TRL's GRPO flags"),  # its value is no flag
    (["--gradient_accumulation_steps", "2", "--steps_per_generation", "3", "--num_generations", "4"],
     "steps_per_generation 3 above gradient_accumulation_steps 2 must be a multiple"),
    (["--gradient_accumulation_steps", "4", "--steps_per_generation", "2", "--num_iterations", "2"],
     "--num_iterations 2 with steps_per_generation 2 below gradient_accumulation_steps 4"),
])
def test_flags_alignrl_cannot_honour_are_one_line(argv, words):
    with pytest.raises(TrlFlagError, match=words.replace("(", r"\(").replace(")", r"\)")):
        from_line(["--dataset_name", "d.jsonl", "--reward_funcs", "accuracy_reward", *argv])


def test_unused_flags_are_named_and_a_reward_model_id_is_the_reward_model(tmp_path):
    words, lines = from_line(["--dataset_name", str(_data(tmp_path)), "--reward_funcs", "OpenAssistant/rm-deberta",
                              "--use_vllm", "--vllm_mode", "colocate", "--report_to", "wandb", "trackio", "--max_steps", "1",
                              "actor.lr=2e-6"])
    assert "algorithm.reward_model=OpenAssistant/rm-deberta" in words and words[-1] == "actor.lr=2e-6"
    assert "trainer.logger=[console,jsonl,wandb]" in words
    assert lines[-1].startswith("given, changing nothing here: --use_vllm --vllm_mode (generation runs on")
    assert lines[-1].endswith("; --report_to trackio (alignrl logs to console, jsonl, wandb and tensorboard)")


def _reward(tmp_path: Path, spec: str):
    (tmp_path / "rw.py").write_text(REWARD_FILE)
    return load_reward_fn("trl:" + spec.replace("FILE", str(tmp_path / "rw.py")))


def test_trl_reward_functions_sum_by_weight_and_skip_none(tmp_path, monkeypatch):
    monkeypatch.setenv("SEEN_FILE", str(tmp_path / "seen.jsonl"))
    fn = _reward(tmp_path, "FILE:match;FILE:half@2.0;FILE:skip;think_format_reward@0.25")
    extra = {"prompt": "2+2?", "solution": "4", "level": 1}
    assert fn("math", "<think>x</think> 4", "", extra, prompt="templated") == 1.0 + 2 * 0.5 + 0.25
    assert fn("math", "5", "", extra, prompt="templated") == 1.0  # half's 2 x 0.5 only; skip's None left out
    seen = json.loads((tmp_path / "seen.jsonl").read_text().splitlines()[0])
    assert seen == {"solution": ["4"], "prompts": ["2+2?"], "completions": ["<think>x</think> 4"],
                    "kwargs": ["level", "log_extra", "log_metric", "trainer_state"]}
    only_none = _reward(tmp_path, "FILE:skip")
    assert only_none("math", "x", "", extra) == 0.0  # TRL's nansum of nothing
    assert _reward(tmp_path, "FILE:nan;FILE:half")("math", "x", "", extra) == 0.5  # a NaN skipped as a None
    assert _reward(tmp_path, "FILE:later@2.0")("math", "x", "", extra) == 1.5  # an async function, awaited
    assert load_reward_fn("trl:accuracy_reward")("math", "so \\boxed{4}", "", extra) == 1.0


def test_every_column_of_a_label_less_row_reaches_trl_functions_only(tmp_path, monkeypatch):
    from alignrl.data.loaders import load_samples, write_verl_parquet

    monkeypatch.setenv("SEEN_FILE", str(tmp_path / "seen.jsonl"))
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "2+2?", "solution": "4", "data_source": "arith", "extra_info": {"i": 7},
                                "reward_model": {"ground_truth": "4"}, "completion": "x"}) + "\n")
    row = load_samples(str(path), prompt_key="prompt")[0]
    assert row.extra == {"i": 7}  # the row's own extra_info; its columns ride beside it
    assert pickle.loads(pickle.dumps(row.extra)).columns["solution"] == "4"  # as a timed rule's worker gets it
    assert _reward(tmp_path, "FILE:match")(row.data_source, "4", row.ground_truth, row.extra) == 1.0
    seen = json.loads((tmp_path / "seen.jsonl").read_text())
    assert [k for k in seen["kwargs"] if k not in ("log_extra", "log_metric")] == \
        ["data_source", "extra_info", "reward_model", "trainer_state"]
    assert load_samples(str(path), prompt_key="prompt", label_key="solution")[0].extra == {"i": 7}
    write_verl_parquet([row], tmp_path / "out.parquet")
    assert load_samples(str(tmp_path / "out.parquet"))[0].extra == {"i": 7}


def test_trl_accuracy_reads_the_answer_as_trl_does():
    from alignrl.rewards.trl_reward import accuracy_reward, reasoning_accuracy_reward

    # TRL's math_verify calls: a \\boxed{} or an anchored LaTeX answer only, never a bare number or a #### line
    assert accuracy_reward(["The answer is 42", "#### 42", "$\\boxed{42}$", "$x = 3$"], ["42", "42", "42", "3"]) == \
        [0.0, 0.0, 1.0, 0.0]
    assert accuracy_reward(["$\\boxed{42}$"], ["no math here"]) == [None]  # a gold that does not parse: skipped
    assert reasoning_accuracy_reward(["<think>$\\boxed{1}$</think> $\\boxed{42}$", "$\\boxed{42}$"], ["42", "42"]) == \
        [1.0, 0.0]


def test_trl_reward_function_errors_name_the_function(tmp_path):
    with pytest.raises(ScoreError, match=r"rw.py:broken raised ValueError: no answer column"):
        _reward(tmp_path, "FILE:broken")("math", "x", "", {"prompt": "p"})
    with pytest.raises(ScoreError, match=r"rw.py:two returned 2 values for one completion"):
        _reward(tmp_path, "FILE:two")("math", "x", "", {"prompt": "p"})
    with pytest.raises(RewardError, match="defines no function 'absent'"):
        _reward(tmp_path, "FILE:absent")
    with pytest.raises(RewardError, match="is none of TRL's built-ins"):
        load_reward_fn("trl:format_reward")
    assert import_file  # the registry's importer loads the files


def test_a_trl_line_trains_the_tiny_model_and_its_reward_reads_the_columns(tmp_path, tiny_model_dir, monkeypatch,
                                                                             cli_in_process):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SEEN_FILE", str(tmp_path / "seen.jsonl"))
    (tmp_path / "rw.py").write_text(REWARD_FILE)
    data = _data(tmp_path)
    done = cli_in_process("train", "grpo", "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(data),
                          "--reward_funcs", "rw.py:match", "accuracy_reward", "--reward_weights", "1", "0.5",
                          "--output_dir", str(tmp_path / "out"), "--num_generations", "2",
                          "--per_device_train_batch_size", "4", "--max_steps", "2", "--max_completion_length", "6",
                          "--max_prompt_length", "64", "--learning_rate", "1e-3", "--gradient_checkpointing", "false",
                          "trainer.device=cpu", "data.val_size=2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "TRL's batches: per_device_train_batch_size 4 x 1 rank(s)" in done.stderr
    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    solutions = [one for s in seen for one in s["solution"]]
    assert set(solutions) <= {str(i + 1) for i in range(8)} and len(solutions) >= 8
    # one call per rollout batch, as TRL calls its functions once per generation batch: 2 prompts x 2 completions
    assert max(len(s["completions"]) for s in seen) == 4
    assert all(len(s["prompts"]) == len(s["completions"]) == len(s["solution"]) for s in seen)
    assert seen[0]["prompts"][0][0]["role"] == "user" and seen[0]["completions"][0][0]["role"] == "assistant"
    assert "level" in seen[0]["kwargs"]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 2
    assert list((tmp_path / "out" / "logs").iterdir())


def test_a_bad_trl_flag_through_the_cli_is_one_line(cli_in_process):
    done = cli_in_process("train", "grpo", "--dataset_name", "d.jsonl", "--reward_funcs", "accuracy_reward",
                          "--load_in_4bit")
    assert done.returncode == 2
    assert "error: --load_in_4bit quantizes the frozen base under LoRA adapters (QLoRA)" in one_line(done.stderr)
