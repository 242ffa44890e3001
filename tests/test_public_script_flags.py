"""Flags and keys of public example scripts that were refused, now read: TRL's --dtype/--torch_dtype, --optim,
--dataset_num_proc and --report_to with an integration without a sink here on the offline commands; OpenRLHF's
--dataset_probs and ppo-ray's --async_train; verl's other trackers, `+rollout.repetition_penalty`/min_p and the
older top-level ray_init group. Parse-only: nothing trains."""

import pytest

from alignrl.config import ConfigError, load_config
from alignrl.preference.cli import parse_dpo, parse_rm
from alignrl.preference.sft_cli import parse_sft

TRL = ["--model_name_or_path", "demo", "--dataset_name", "rows.jsonl", "--output_dir", "out"]
OPENRLHF = ["--pretrain", "demo", "--dataset", "rows.jsonl", "--save_path", "out"]


@pytest.mark.parametrize("flags, bf16", [(["--dtype", "bfloat16"], "true"), (["--torch_dtype", "float32"], "auto"),
                                         (["--dtype", "auto"], "auto"), (["--dtype", "float32", "--bf16", "false"],
                                                                         "false")])
def test_trls_dtype_is_bf16(flags, bf16):
    """bfloat16 weights compute in bfloat16; float32 or auto leave TRL's bf16 mixed precision as --bf16 says."""
    assert parse_sft(TRL + flags).bf16 == bf16 and parse_dpo(TRL + flags).bf16 == bf16


def test_what_the_offline_commands_cannot_do_stays_one_line(capsys):
    with pytest.raises(ConfigError, match="^--torch_dtype float16: .*float16 is left out"):
        parse_sft(TRL + ["--torch_dtype", "float16"])
    with pytest.raises(ConfigError, match="^--optim rmsprop: the optimizer is torch's AdamW"):
        parse_dpo(TRL + ["--optim", "rmsprop"])
    with pytest.raises(ConfigError, match="^--dataset_probs: the reward model reads one file per task"):
        parse_rm(OPENRLHF + ["--dataset_probs", "0.7,0.3"])
    parse_sft(TRL + ["--optim", "adamw_torch_fused", "--dataset_num_proc", "8"])
    assert "--dataset_num_proc changes nothing here" in capsys.readouterr().err


def test_a_reporter_without_a_sink_here_is_dropped_with_a_note(capsys):
    assert parse_sft(TRL + ["--report_to", "trackio"]).report_to == ["jsonl"]
    assert "--report_to trackio: no sink here for it; metrics go to jsonl" in capsys.readouterr().err
    assert parse_dpo(TRL + ["--report_to", "tensorboard,mlflow"]).report_to == ["tensorboard"]


def test_openrlhfs_dataset_probs_weigh_the_files(capsys):
    cfg = parse_sft(["--pretrain", "demo", "--dataset", "a.jsonl,b.jsonl", "--dataset_probs", "0.7,0.3"])
    assert cfg.train_files == ["a.jsonl", "b.jsonl"] and [float(p) for p in cfg.train_files_probs] == [0.7, 0.3]
    assert parse_dpo(OPENRLHF + ["--dataset_probs=1"]).train_files_probs == ["1"]  # one file: read as it is
    assert parse_rm(OPENRLHF + ["--dataset_probs", "1.0"]).helpful_train_file == "rows.jsonl"
    assert "--dataset_probs 1.0: the one dataset's share" in capsys.readouterr().err


def test_grpo_takes_adamw_spellings_and_refuses_other_optimizers():
    from alignrl.compat.trl_grpo_flags import TrlFlagError
    from alignrl.compat.trl_grpo_keys import from_line

    line = ["--model_name_or_path", "demo", "--dataset_name", "rows.jsonl", "--reward_funcs", "accuracy_reward"]
    from_line(line + ["--optim", "adamw_torch_fused"])
    with pytest.raises(TrlFlagError, match="^--optim adafactor: the optimizer here is torch's AdamW"):
        from_line(line + ["--optim", "adafactor"])


def test_verl_trackers_without_a_sink_sampling_keys_and_ray_init(capsys, monkeypatch):
    monkeypatch.setenv("ALIGNRL_VERL_KEYS_LISTED", "")  # listed once per process: again here, restored after
    monkeypatch.delenv("ALIGNRL_VERL_KEYS_LISTED")
    words = ["actor_rollout_ref.actor.optim.lr=1e-6", "trainer.logger=['console','mlflow']",
             "+actor_rollout_ref.rollout.repetition_penalty=1.1", "+actor_rollout_ref.rollout.min_p=0.05",
             "ray_init.num_cpus=8"]
    cfg = load_config(None, words)
    assert cfg.trainer.logger == ["console", "jsonl"]  # mlflow's metrics in metrics.jsonl
    assert (cfg.rollout.repetition_penalty, cfg.rollout.min_p) == (1.1, 0.05)
    err = capsys.readouterr().err
    assert "trainer.logger=mlflow is accepted but not applied" in err and "ray_init.num_cpus" in err


def test_openrlhfs_async_train_runs_each_step_on_its_own_policy():
    from alignrl.compat import openrlhf_flags as F
    from alignrl.compat.openrlhf_recent import recent_unused

    args = F.parser().parse_args(["--pretrain", "demo", "--async_train", "--async_queue_size", "2"])
    F.check(args)
    (why,) = [w for flags, w in recent_unused(args) if "async_train" in flags]
    assert "generation and training take turns" in why


def test_checkpoint_flags_that_change_nothing_here_are_noted(capsys):
    cfg = parse_sft(TRL + ["--save_only_model", "--save_steps", "0.1"])
    assert cfg.save_steps == 0.1 and "--save_only_model changes nothing here" in capsys.readouterr().err
    parse_sft(OPENRLHF + ["--max_ckpt_mem", "1000", "--disable_ds_ckpt", "--save_hf_ckpt"])
    err = capsys.readouterr().err
    assert all(f"--{f} changes nothing here" in err for f in ("max_ckpt_mem", "disable_ds_ckpt", "save_hf_ckpt"))


def test_trls_eval_strategy_steps_without_eval_steps_takes_logging_steps():
    assert parse_sft(TRL + ["--eval_strategy", "steps", "--logging_steps", "25"]).eval_steps == 25
    assert parse_sft(TRL + ["--eval_strategy", "steps", "--eval_steps", "7"]).eval_steps == 7
