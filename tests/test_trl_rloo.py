"""`alignrl train rloo`: TRL's `trl rloo` command line (RLOOConfig's flags) on the RL loop, the config's refusals of
the sequence ratio's loss, and one short real run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from alignrl.compat.trl_grpo_flags import TrlFlagError
from alignrl.compat.trl_rloo import from_line
from alignrl.config import ConfigError, load_config

from conftest import one_line


def _data(tmp_path: Path, rows: int = 8) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i}+1?"}],
                                        "solution": str(i + 1)}) + "\n" for i in range(rows)))
    return path


def _config(argv: list[str]):
    words, lines = from_line(argv)
    return load_config(None, [w for w in words if "=" in w]), words, lines


def test_a_trl_rloo_line_becomes_the_rloo_recipe(tmp_path):
    model = tmp_path / "sft"
    cfg, words, lines = _config(["--model_name_or_path", str(model), "--dataset_name", str(_data(tmp_path)),
                                 "--reward_funcs", "accuracy_reward", "--output_dir", str(tmp_path / "rloo-run"),
                                 "--num_generations", "4", "--per_device_train_batch_size", "8",
                                 "--gradient_accumulation_steps", "2", "--num_iterations", "2", "--beta", "0.1",
                                 "--epsilon", "0.1", "--epsilon_high", "0.28", "--normalize_advantages",
                                 "--reward_clip_range", "-2", "3", "--mask_truncated_completions", "--max_steps", "8",
                                 "--sync_ref_model", "--ref_model_sync_steps", "64", "--nproc", "2"])
    # 8 x 2 ranks x 2 accumulation = 32 completions a round = 8 prompts x 4; two passes, one optimizer step each
    assert (cfg.data.train_batch_size, cfg.rollout.n, cfg.actor.ppo_epochs) == (8, 4, 2)
    act = cfg.actor
    assert (act.ppo_mini_batch_size, act.ppo_micro_batch_size, cfg.trainer.total_training_steps) == (8, 8, 4)
    a = cfg.algorithm
    assert (a.adv_estimator, act.policy_loss, act.clip_ratio_low, act.clip_ratio_high) == ("rloo", "seq_ppo_clip",
                                                                                           0.1, 0.28)
    assert (a.use_kl_in_reward, a.kl_coef, a.kl_penalty, a.kl_ctrl_type, act.use_kl_loss) == (True, 0.1, "k1", "fixed",
                                                                                              False)
    assert (a.grpo_std_scope, a.reward_clip, a.mask_truncated) == ("batch", [-2.0, 3.0], True)
    # TRL moves the reference every 64 optimizer steps: 32 RL steps of two optimizer steps each
    assert (act.ref_sync_steps, act.ref_mixup_alpha, act.recompute_old_logprobs) == (32, 0.6, True)
    assert a.reward_fn == "trl:accuracy_reward" and cfg.model.path == str(model) and words[-2:] == ["--nproc", "2"]
    assert lines[1].startswith("TRL's batches: per_device_train_batch_size 8 x 2 rank(s) x gradient_accumulation_"
                               "steps 2 = 32 completions per optimizer step")
    assert "TRL's RLOOConfig has none" in lines[2]
    assert lines[3].startswith("--mask_truncated_completions: a truncated answer leaves the loss's count of answers")
    assert lines[3].endswith("it also keeps its KL penalty in its reward (TRL's drops it)")
    _, _, lines = _config(["--dataset_name", str(_data(tmp_path)), "--reward_funcs", "accuracy_reward",
                           "--mask_truncated_completions", "--num_iterations", "2", "--sync_ref_model", "--beta",
                           "0.1", "--ref_model_sync_steps", "5"])
    assert any(x.startswith("--ref_model_sync_steps 5: the reference moves after every 2 RL step(s) of 2 optimizer "
                            "steps (4 optimizer steps, where TRL's moves it after 5)") for x in lines)


def test_rloo_config_defaults_are_taken_when_the_line_is_silent(tmp_path):
    cfg, _, lines = _config(["--dataset_name", str(_data(tmp_path)), "--reward_model_name_or_path", "org/rm",
                             "actor.lr=2e-6"])
    a, r = cfg.algorithm, cfg.rollout
    assert (cfg.rollout.n, a.use_kl_in_reward, a.kl_coef, a.grpo_std_scope, a.reward_clip) == (2, True, 0.05, "group",
                                                                                               [])
    assert (r.max_new_tokens, r.temperature, r.top_k, cfg.actor.clip_ratio_high) == (256, 1.0, -1, 0.2)
    assert cfg.actor.lr == 2e-6 and a.reward_model == "org/rm"  # alignrl's own key after the flags wins
    for default in ("learning_rate 1e-06", "num_generations 2", "beta 0.05", "normalize_advantages False"):
        assert default in lines[0]
    assert "bf16 True" in lines[0].split("not taken: ")[1]
    cfg, _, _ = _config(["--dataset_name", str(_data(tmp_path)), "--reward_funcs", "accuracy_reward", "--beta", "0"])
    assert not cfg.algorithm.use_kl_in_reward and not cfg.actor.use_kl_loss  # no reference at all, as TRL's


@pytest.mark.parametrize("argv,words", [
    (["--num_generations", "1"], "--num_generations 1: RLOO needs at least 2 generations per prompt"),
    (["--reward_clip_range", "1", "-1"], "--reward_clip_range 1.0 -1.0: give two different numbers, the lower"),
    (["--reward_clip_range", "1", "1"], "--reward_clip_range 1.0 1.0: give two different numbers, the lower"),
    (["--num_iterations", "0"], "--num_iterations 0: give 1 or more"),
    (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps 0: give 1 or more"),
    (["--sync_ref_model", "--ref_model_sync_steps", "0"], "--ref_model_sync_steps 0 with --sync_ref_model: give 1"),
    (["--sync_ref_model", "--beta", "0"], "--sync_ref_model moves the reference the KL penalty reads"),
    (["--loss_type", "dapo", "--scale_rewards", "batch"], "'--loss_type', '--scale_rewards' are not one of TRL's "
                                                          "RLOO flags"),
    (["--load_in_8bit"], "--load_in_8bit is not supported here: alignrl quantizes to 4-bit only"),
    (["--load_in_4bit"], "--load_in_4bit quantizes the frozen base under LoRA adapters (QLoRA), and trains nothing "
                         "without them: add --use_peft"),
])
def test_what_alignrl_cannot_take_is_one_line(argv, words):
    with pytest.raises(TrlFlagError, match=words.replace("(", r"\(").replace(")", r"\)")):
        from_line(["--dataset_name", "d.jsonl", "--reward_funcs", "accuracy_reward", *argv])


@pytest.mark.parametrize("keys,words", [
    (["actor.top_entropy_quantile=0.2"], "actor.top_entropy_quantile leaves single tokens out of it"),
    (["algorithm.rollout_is=token"], "algorithm.rollout_is=token weighs each token apart"),
    (["actor.clip_ratio_delta=1.5"], "actor.clip_ratio_delta caps the unclipped ratio term of"),
    (["critic.enable=true", "algorithm.adv_estimator=gae"], "a critic gives each token its own"),
    (["algorithm.adv_estimator=reinforce_plus_plus"], "adv_estimator=reinforce_plus_plus gives each token its own"),
])
def test_the_sequence_ratios_loss_refuses_what_weighs_single_tokens(keys, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, ["actor.policy_loss=seq_ppo_clip", "actor.recompute_old_logprobs=true", *keys])


def test_batch_normalisation_is_grpos_and_rloos_only():
    assert load_config(None, ["algorithm.adv_estimator=rloo", "algorithm.grpo_std_scope=batch"])
    with pytest.raises(ConfigError, match="grpo_std_scope=batch scales GRPO's or RLOO's advantages"):
        load_config(None, ["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.grpo_std_scope=batch"])


def test_a_trl_yaml_of_rloo_keys_and_the_flags_that_change_nothing(tmp_path, cli_in_process):
    from alignrl.compat.trl_config_file import expand
    from alignrl.compat.trl_rloo import parser

    recipe = tmp_path / "rloo.yaml"
    recipe.write_text(f"dataset_name: {_data(tmp_path)}\nreward_funcs: [accuracy_reward]\nbeta: 0.3\n"
                      "num_generations: 4\nreward_clip_range: [-1, 1]\n")
    cfg, _, _ = _config(expand(["--config", str(recipe), "--beta", "0.2"], parser(), "TRL's RLOO"))
    assert (cfg.algorithm.kl_coef, cfg.rollout.n, cfg.algorithm.reward_clip) == (0.2, 4, [-1.0, 1.0])
    _, _, lines = _config(["--dataset_name", str(_data(tmp_path)), "--reward_funcs", "accuracy_reward",
                           "--use_vllm", "--vllm_mode", "colocate", "--log_completions"])
    assert lines[-1].startswith("given, changing nothing here: --use_vllm --vllm_mode (generation runs on")
    done = cli_in_process("train", "rloo", "--dataset_name", "d.jsonl")
    assert done.returncode == 2 and "error: give --reward_funcs" in one_line(done.stderr)


def test_an_rloo_line_trains_the_tiny_model_with_its_kl_in_the_reward(tmp_path, tiny_model_dir, monkeypatch,
                                                                      cli_in_process):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "length.py").write_text("def length(completions, **kwargs):\n"  # a reward that differs in a group
                                        "    return [float(len(c[0]['content'])) for c in completions]\n")
    done = cli_in_process("train", "rloo", "--model_name_or_path", str(tiny_model_dir), "--dataset_name",
                          str(_data(tmp_path)), "--output_dir", str(tmp_path / "out"), "--reward_funcs",
                          f"{tmp_path / 'length.py'}:length", "--per_device_train_batch_size", "4", "--max_steps", "2",
                          "--max_completion_length", "6", "--learning_rate", "1e-2", "--gradient_checkpointing",
                          "false", "--normalize_advantages", "trainer.device=cpu", "data.val_size=2",
                          "trainer.logger=[jsonl]")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "TRL's batches: per_device_train_batch_size 4 x 1 rank(s)" in done.stderr
    rows = [json.loads(x) for x in (tmp_path / "out" / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/grad_norm" in r]
    assert len(steps) == 2 and all(math.isfinite(r["actor/grad_norm"]) and r["actor/grad_norm"] > 0 for r in steps)
    assert steps[0]["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # one pass: the ratio is 1
    # beta 0.05: the KL to the reference is in the reward, 0 before the first update and not after it
    assert steps[0]["actor/reward_kl_penalty"] == 0 and steps[1]["actor/reward_kl_penalty"] != 0
    assert steps[1]["actor/reward_kl_penalty_coeff"] == 0.05
