"""`alignrl train opd` (OpenRLHF's train_opd flags): the flags as the on-policy distillation recipe's keys with
OpenRLHF's defaults, its refusals and what is not available here in one line, the flags that change nothing named,
and one step of the tiny model distilled from itself (the reward's KL term exactly 0) and from another teacher."""

import json
import os
import runpy
import sys
from pathlib import Path

import pytest

from alignrl.compat import openrlhf_opd as O
from alignrl.config import load_config


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"question": f"count from {i}"}) + "\n" for i in range(10)))
    return path


def _line(prompts, *more):
    return ["--model.model_name_or_path", "student", "--teacher.model_name_or_path", "teacher",
            "--data.prompt_dataset", str(prompts), "--data.max_len", "2048", *more]


def _cfg(prompts, *more):
    a = vars(O.parser().parse_args(_line(prompts, *more)))
    O.check(a)
    return load_config(None, O.overrides(a, False))


def test_the_flags_are_the_recipe_with_openrlhfs_defaults(prompts):
    cfg = _cfg(prompts, "--train.batch_size", "4", "--train.max_epochs", "2", "--data.input_key", "question")
    assert (cfg.model.path, cfg.model.ref_path, cfg.algorithm.reward_fn) == ("student", "teacher", "zero")
    a = cfg.algorithm
    assert (a.use_kl_in_reward, a.kl_coef, a.kl_penalty, a.kl_ctrl_type, a.adv_estimator, a.gamma,
            a.whiten_advantages) == (True, 1, "k1", "fixed", "reinforce_plus_plus", 0, "none")
    assert (cfg.actor.use_kl_loss, cfg.actor.ppo_epochs, cfg.rollout.n) == (False, 1, 1)
    assert cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size == 4  # one on-policy update a batch
    assert (cfg.rollout.temperature, cfg.rollout.top_p) == (1, 1)
    assert cfg.trainer.total_training_steps == 2 * (10 // 4) and cfg.trainer.total_epochs == 2
    assert (cfg.actor.lr, cfg.actor.betas, cfg.actor.lr_scheduler, cfg.actor.min_lr_ratio,
            cfg.actor.lr_warmup_steps_ratio) == (1e-6, [0.9, 0.95], "cosine", 0.1, 0.03)
    assert (cfg.actor.ppo_micro_batch_size, cfg.data.max_prompt_length, cfg.rollout.max_new_tokens) == (8, 1024, 1024)
    assert (cfg.data.prompt_key, cfg.data.apply_chat_template, cfg.trainer.resume_mode) == ("question", False,
                                                                                             "disable")
    # OpenRLHF's warm-up count, ceil(4 steps × 0.03) = 1 (the ratio's floor would be none); its prompts cut at the
    # end; no held-out prompts without --eval.dataset (one, the loop's least) and none evaluated during training
    assert cfg.actor.lr_warmup_steps == 1 and cfg.data.truncation == "right"
    assert (cfg.data.val_size, cfg.trainer.test_freq) == (1, 0)
    held = _cfg(prompts, "--train.batch_size", "4", "--eval.dataset", str(prompts), "--eval.steps", "3")
    assert (held.data.val_size, held.trainer.test_freq) == (64, 3)


def test_optimiser_checkpoint_and_lora_flags_map(prompts, tmp_path):
    cfg = _cfg(prompts, "--train.batch_size", "2", "--adam.lr", "3e-5", "--adam.betas", "0.8", "0.9", "--lr_scheduler",
               "constant", "--max_norm", "0.5", "--ckpt.output_dir", str(tmp_path / "out"), "--ckpt.save_steps", "5",
               "--ckpt.load_enable", "--ds.lora.rank", "8", "--data.apply_chat_template")
    assert (cfg.actor.lr, cfg.actor.betas, cfg.actor.lr_scheduler, cfg.actor.lr_warmup_steps_ratio,
            cfg.actor.grad_clip) == (3e-5, [0.8, 0.9], "constant", 0.0, 0.5)
    assert (cfg.run_dir, cfg.trainer.save_freq, cfg.trainer.resume_mode) == (tmp_path / "out", 5, "auto")
    assert (cfg.model.lora_rank, cfg.data.apply_chat_template) == (8, True)


@pytest.mark.parametrize("more, words", [
    (["--opd.topk", "8"], "top-k full-distribution mode"),
    (["--generate.top_p", "0.9"], "must be 1.0 with --opd.topk 0"),
    (["--generate.temperature", "0.7"], "must be 1.0 with --opd.topk 0"),
    (["--optim", "muon"], "Muon is not available"),
    (["--ds.zero_stage", "3"], "ZeRO stage 3"),
    (["--data.max_len", "512"], "exceeds --data.max_len 512"),
    (["--train.batch_size", "64"], "fewer than --train.batch_size 64"),
    (["--opd.kd_temperature", "0"], "--opd.kd_temperature must be above 0"),
    (["--data.max_samples", "0"], "--data.max_samples must be at least 1"),
    (["--data.prompt_probs", "0.5,0.5"], "2 probabilities for 1 --data.prompt_dataset files; give one per file"),
    (["--data.prompt_dataset", "/no/such.jsonl"], "set --data.prompt_dataset to an existing"),
])
def test_what_is_refused_is_one_line(prompts, capsys, more, words):
    assert O.main(_line(prompts, *more)) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err and err.startswith("alignrl train opd: error:")


def test_the_runs_own_errors_name_this_commands_flags(prompts, capsys, tmp_path):
    """An error the run meets after the flags' checks (the held-out file, the prompt column) names the flag."""
    from alignrl.errors import FLAGS_ENV, PROGRAM_ENV, in_flag_words

    out = ["--ckpt.output_dir", str(tmp_path / "out"), "--ckpt.path", str(tmp_path / "ck"), "--train.batch_size", "4"]
    assert O.main(_line(prompts, *out, "--eval.dataset", str(tmp_path / "none.jsonl"))) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("data file not found: " + str(tmp_path / "none.jsonl") + " (set --eval.dataset to an "
                        "existing .jsonl, .json or .parquet file)") and err.startswith("alignrl train opd: error:")
    assert FLAGS_ENV not in os.environ and PROGRAM_ENV not in os.environ  # the run's wording ends with it
    names = O.flag_names(vars(O.parser().parse_args(_line(prompts))))
    said = in_flag_words("row has no 'input' column (data.prompt_key names the prompt column)", names)
    assert said.endswith("(--data.input_key names the prompt column)")


def test_an_unknown_flag_or_a_missing_teacher_is_one_line(prompts, capsys):
    with pytest.raises(SystemExit) as e:
        O.parser().parse_args(_line(prompts, "--opd.no_such_flag", "1"))
    assert e.value.code == 2 and "--opd.no_such_flag" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # OpenRLHF's choices
        O.parser().parse_args(_line(prompts, "--opd.kl_estimator", "k9"))
    assert e.value.code == 2 and "invalid choice: 'k9'" in capsys.readouterr().err
    assert O.main(["--model.model_name_or_path", "s", "--data.prompt_dataset", str(prompts)]) == 2
    assert "--teacher.model_name_or_path is required" in capsys.readouterr().err


def test_openrlhfs_module_spelling_runs_the_command(prompts, capsys, monkeypatch):
    root = Path(__file__).resolve().parents[1]
    shim = str(root / "openrlhf" / "cli" / "train_opd.py")
    monkeypatch.syspath_prepend(str(root))  # `python3 -m openrlhf.cli.train_opd` from the repository root
    monkeypatch.setattr(sys, "argv", [shim, *_line(prompts, "--opd.topk", "4")])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(shim, run_name="__main__")
    err = capsys.readouterr().err.strip()
    assert done.value.code == 2 and err.startswith("alignrl train opd: error: --opd.topk > 0")


def test_flags_that_change_nothing_are_named(prompts):
    a = vars(O.parser().parse_args(_line(prompts, "--opd.kl_estimator", "k1", "--model.beta", "0.2",
                                         "--ds.zero_stage", "1", "--logger.logging_steps", "1")))
    lines = O.unused(a, False)
    assert any(line.startswith("--opd.kl_estimator (the reward is always k1") for line in lines)
    assert "--model.beta (not used by train_opd (its loss has no beta))" in lines
    assert "--ds.zero_stage (no CUDA)" in lines and not any("logging_steps" in line for line in lines)


def test_one_step_distilled_from_itself_and_from_another_teacher(tiny_model_dir, tmp_path):
    """Through `alignrl train opd` as the shim runs it: with the student as its own teacher every token's reward (the
    teacher's log-prob minus the student's) is 0; with another teacher (the student's weights moved) it is not,
    while the task reward stays 0; the trained model is left in --ckpt.output_dir."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from alignrl.cli import main

    other = tmp_path / "teacher"
    shutil.copytree(tiny_model_dir, other)
    torch.manual_seed(0)
    moved = {k: v + 0.05 * torch.randn_like(v) for k, v in load_file(str(other / "model.safetensors")).items()}
    save_file(moved, str(other / "model.safetensors"))
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"input": f"count from {i}"}) + "\n" for i in range(2)))
    kl = {}
    for name, teacher in (("self", tiny_model_dir), ("other", other)):
        out = tmp_path / name
        assert main(["train", "opd", "--model.model_name_or_path", str(tiny_model_dir),
                     "--teacher.model_name_or_path", str(teacher), "--data.prompt_dataset", str(data),
                     "--train.batch_size", "2", "--data.prompt_max_len", "32", "--generate.max_new_tokens", "4",
                     "--data.max_len", "36", "--ckpt.output_dir", str(out), "--ckpt.path",
                     str(tmp_path / f"ckpts_{name}")]) == 0
        rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
        step = [r for r in rows if "actor/reward_kl_penalty" in r][-1]
        assert step["actor/reward_kl_penalty_coeff"] == 1.0 and step["reward/mean"] == 0.0
        assert (out / "model.safetensors").is_file()
        kl[name] = step["actor/reward_kl_penalty"]
    assert kl["self"] == 0.0 and kl["other"] != 0.0, kl
