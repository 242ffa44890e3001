"""`alignrl train online-dpo`: TRL's dpo_online.py command line (OnlineDPOConfig's flags) on the RL loop."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from alignrl.compat.trl_grpo_flags import TrlFlagError
from alignrl.compat.trl_online_dpo import from_line
from alignrl.config import load_config

from conftest import one_line


def _data(tmp_path: Path, rows: int = 8) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i}+1?"}],
                                        "solution": str(i + 1)}) + "\n" for i in range(rows)))
    return path


def _config(argv: list[str]):
    words, lines = from_line(argv)
    return load_config(None, [w for w in words if "=" in w]), words, lines


def test_trls_dpo_online_line_becomes_the_online_dpo_recipe(tmp_path):
    # examples/scripts/dpo_online.py's usage line, on a local model folder and data file, on 2 ranks
    model, rm = tmp_path / "sft", tmp_path / "rm"
    cfg, words, lines = _config(["--model_name_or_path", str(model), "--reward_model_path", str(rm),
                                 "--dataset_name", str(_data(tmp_path)), "--learning_rate", "5.0e-7",
                                 "--output_dir", str(tmp_path / "pythia-1b-tldr-online-dpo"),
                                 "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "16",
                                 "--warmup_ratio", "0.1", "--missing_eos_penalty", "1.0", "--max_steps", "20",
                                 "--nproc", "2"])
    # 8 prompts x 2 ranks x 16 accumulation = 256 prompts an optimizer step, two answers each: one RL step
    assert (cfg.data.train_batch_size, cfg.rollout.n, cfg.actor.ppo_mini_batch_size) == (256, 2, 256)
    assert (cfg.actor.ppo_mini_batch_unit, cfg.actor.ppo_micro_batch_size, cfg.actor.ppo_epochs) == ("prompts", 16, 1)
    assert cfg.mini_batches_per_step == 1 and cfg.trainer.total_training_steps == 20
    assert cfg.actor.lr_warmup_steps == 2  # ceil(0.1 x 20 optimizer steps), transformers' count
    a = cfg.algorithm
    assert (a.adv_estimator, a.dpo_beta, a.dpo_loss_type, a.missing_eos_penalty) == ("online_dpo", 0.1, "sigmoid", 1.0)
    assert (a.reward_model, a.use_kl_in_reward, cfg.actor.use_kl_loss) == (str(rm), False, False)
    assert cfg.actor.recompute_old_logprobs and cfg.actor.lr == 5e-7 and cfg.model.path == str(model)
    assert (cfg.trainer.experiment_name, cfg.trainer.output_dir) == ("pythia-1b-tldr-online-dpo", str(tmp_path))
    assert words[-2:] == ["--nproc", "2"]
    assert lines[1].startswith("TRL's batches: per_device_train_batch_size 8 prompts x 2 rank(s) x "
                               "gradient_accumulation_steps 16 = 256 prompts per optimizer step")


def test_a_reward_function_beside_the_reward_model_is_summed_with_it_as_trl_sums_them(tmp_path):
    line = ["--dataset_name", str(_data(tmp_path)), "--reward_model_path", "org/rm"]
    cfg = _config([*line, "algorithm.reward_fn=trl:accuracy_reward"])[0]
    assert (cfg.algorithm.reward_model, cfg.algorithm.reward_model_mix) == ("org/rm", "sum")
    assert _config([*line, "algorithm.reward_fn=trl:accuracy_reward", "algorithm.reward_model_mix=add"])[0] \
        .algorithm.reward_model_mix == "add"
    assert _config(line)[0].algorithm.reward_model_mix == "replace"


def test_online_dpo_config_defaults_are_taken_when_the_line_is_silent(tmp_path):
    cfg, _, lines = _config(["--dataset_name", str(_data(tmp_path)), "--reward_model_path", "org/rm",
                             "--loss_type", "ipo", "--beta", "0.5", "actor.lr=2e-6"])
    r = cfg.rollout
    assert (r.max_new_tokens, r.temperature, r.top_p, r.top_k) == (64, 0.9, 1.0, -1)
    assert (cfg.algorithm.dpo_loss_type, cfg.algorithm.dpo_beta, cfg.algorithm.missing_eos_penalty) == ("ipo", 0.5, 0)
    assert cfg.data.max_prompt_length == 512 - 64 and cfg.data.truncation == "left"
    assert cfg.actor.lr == 2e-6  # alignrl's own key after the flags wins
    assert (cfg.data.train_batch_size, cfg.trainer.total_epochs, cfg.trainer.save_freq) == (8, 3, 500)
    assert "learning_rate 5e-07" in lines[0] and "max_new_tokens 64" in lines[0] and "temperature 0.9" in lines[0]
    assert ", beta 0.1" not in lines[0] and "loss_type sigmoid" not in lines[0]  # given
    assert "missing_eos_penalty None (no penalty)" in lines[0]


@pytest.mark.parametrize("argv,words", [
    (["--beta", "0.1", "0.2"], "--beta 0.1 0.2: TRL's per-epoch schedule of beta is not available here"),
    (["--judge", "pair_rm"], "--judge is not supported here: alignrl scores each answer on its own; give a reward "
                             "model with --reward_model_path"),
    (["--no_such_flag", "1", "--num_generations", "4"], "'--no_such_flag', '--num_generations' are not one of TRL's "
                                                        "online DPO flags"),
    (["--max_new_tokens", "512"], "--max_new_tokens 512 is not below --max_length 512"),
])
def test_what_alignrl_cannot_take_is_one_line(argv, words):
    with pytest.raises(TrlFlagError, match=words.replace("(", r"\(").replace(")", r"\)")):
        from_line(["--dataset_name", "d.jsonl", "--reward_model_path", "org/rm", *argv])


def test_a_line_without_a_reward_and_the_vllm_flags(tmp_path, cli_in_process):
    done = cli_in_process("train", "online_dpo", "--dataset_name", "d.jsonl")
    assert done.returncode == 2 and "error: give --reward_model_path" in one_line(done.stderr)
    _, words, lines = _config(["--dataset_name", str(_data(tmp_path)), "--use_vllm", "--vllm_mode", "colocate",
                               "algorithm.reward_fn=trl:accuracy_reward"])
    assert lines[-1].startswith("given, changing nothing here: --use_vllm --vllm_mode (generation runs on")
    assert "algorithm.reward_fn=trl:accuracy_reward" in words and not any("reward_model=" in w for w in words)


def test_a_trl_yaml_of_online_dpo_keys_is_read_as_flags(tmp_path):
    from alignrl.compat.trl_config_file import expand
    from alignrl.compat.trl_online_dpo import parser

    recipe = tmp_path / "online_dpo.yaml"
    recipe.write_text(f"dataset_name: {_data(tmp_path)}\nreward_model_path: org/rm\nbeta: 0.3\nmax_new_tokens: 32\n")
    cfg, _, _ = _config(expand(["--config", str(recipe), "--beta", "0.2"], parser(), "TRL's online DPO"))
    assert (cfg.algorithm.dpo_beta, cfg.rollout.max_new_tokens) == (0.2, 32)  # the line wins over the file


def test_an_online_dpo_line_trains_the_tiny_model_and_logs_the_dpo_loss(tmp_path, tiny_model_dir, monkeypatch,
                                                                       cli_in_process):
    monkeypatch.chdir(tmp_path)
    done = cli_in_process("train", "online-dpo", "--model_name_or_path", str(tiny_model_dir), "--dataset_name",
                          str(_data(tmp_path)), "--output_dir", str(tmp_path / "out"),
                          "--per_device_train_batch_size", "2", "--max_steps", "2", "--max_new_tokens", "6",
                          "--max_length", "70", "--learning_rate", "1e-2", "--gradient_checkpointing", "false",
                          "--missing_eos_penalty", "1.0", "algorithm.reward_fn=trl:accuracy_reward",
                          "trainer.device=cpu", "data.val_size=2", "trainer.logger=[jsonl]")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "TRL's batches: per_device_train_batch_size 2 prompts x 1 rank(s)" in done.stderr
    rows = [json.loads(x) for x in (tmp_path / "out" / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/grad_norm" in r]
    assert len(steps) == 2 and all(math.isfinite(r["dpo/loss"]) for r in steps)
    assert steps[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy == reference at the first step


def test_an_epoch_counted_run_says_how_many_prompts_each_epoch_leaves_out_and_rounds_its_warmup_up(tmp_path):
    """10 prompts in batches of 4: the loop trains 2 batches an epoch and leaves 2 prompts out (TRL trains them as a
    smaller last batch), which the start says; 3 epochs are 6 optimizer steps, and --warmup_ratio 0.1 of them is
    ceil(0.6) = 1 warm-up step, as transformers counts it (not 0)."""
    from alignrl.data.sampler import BatchSampler

    line = ["--dataset_name", str(_data(tmp_path, rows=10)), "--reward_model_path", "org/rm",
            "--per_device_train_batch_size", "4", "--warmup_ratio", "0.1"]
    cfg, words, lines = _config(line)
    assert (cfg.trainer.total_training_steps, cfg.actor.lr_warmup_steps) == (6, 1)
    assert not any(w.startswith("actor.lr_warmup_steps_ratio=") for w in words)
    (said,) = [x for x in lines if "not trained each epoch" in x]
    assert said.startswith("2 of the 10 training prompts are not trained each epoch (a different draw each epoch, "
                           "the order shuffled): the loop draws whole batches of 4 prompts, 2 an epoch")
    # what the loop's sampler draws in an epoch: 8 of the 10 prompts, as the line says
    sampler = BatchSampler(10, cfg.data.draw_size, cfg.trainer.seed, cfg.data.shuffle)
    drawn = {i for _ in range(2) for i in sampler.next()}
    assert len(drawn) == 8
    assert _config([*line, "data.shuffle=false"])[2][-1].startswith(
        "2 of the 10 training prompts are not trained each epoch (the data's last rows)")
    # alignrl's own warm-up key after the flags wins
    assert _config([*line, "actor.lr_warmup_steps_ratio=0.5"])[0].actor.lr_warmup_steps == 3


@pytest.mark.parametrize("flags,said", [
    (["--max_steps", "2"], False),  # the run ends within the first epoch's whole batches
    (["--max_steps", "3"], True),  # past the first epoch's end
    (["--per_device_train_batch_size", "5"], False),  # batches of 5 divide the 10 prompts
])
def test_the_left_out_line_comes_only_when_prompts_are_left_out(flags, said, tmp_path):
    _, _, lines = _config(["--dataset_name", str(_data(tmp_path, rows=10)), "--reward_model_path", "org/rm",
                           "--per_device_train_batch_size", "4", *flags])
    assert any("not trained each epoch" in x for x in lines) == said
