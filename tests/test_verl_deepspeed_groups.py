"""verl's DeepSpeed PPO example (examples/ppo_trainer/run_qwen3-0.6b_ds_gsm8k.sh,
verl-project/verl@5930514515391ce45401eee0ca76bcc90d046bb5) runs as `alignrl train ppo` with its arguments unchanged:
main_ppo's own `-cn ppo_trainer`, Hydra's selection of verl's ds_actor / ds_critic groups and the DeepSpeed engine's
ZeRO stage and offload become alignrl's trainer.strategy, zero_stage and offload; another group or option is one
line."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys

import pytest

from alignrl.config import load_config
from conftest import run_group
from test_verl07_sweep import _list_again, files, one_line  # noqa: F401 (fixtures shared with the sweep's tests)

# Everything after `python3 -m verl.trainer.main_ppo` in the script, with its defaults (ZERO_STAGE=2, OFFLOAD=none,
# STEPS=60) filled in and the shell's variables as the tests fill them in ($M: the model; $TRAIN, $TEST: the data).
DS_PPO = """-cn ppo_trainer actor@actor_rollout_ref.actor=ds_actor critic=ds_critic
 actor_rollout_ref.actor.strategy=deepspeed trainer.use_legacy_worker_impl=enable actor_rollout_ref.rollout.name=vllm
 actor_rollout_ref.rollout.mode=async actor_rollout_ref.rollout.load_format=auto
 actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.max_model_len=512
 actor_rollout_ref.rollout.max_num_seqs=8 actor_rollout_ref.rollout.max_num_batched_tokens=1024
 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.2
 actor_rollout_ref.model.path="$M" critic.model.path="$M" actor_rollout_ref.model.trust_remote_code=True
 critic.model.trust_remote_code=True data.trust_remote_code=True
 +actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2
 +critic.model.override_config.attn_implementation=flash_attention_2
 actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.model.use_remove_padding=True
 actor_rollout_ref.actor.ppo_mini_batch_size=32 critic.ppo_mini_batch_size=32
 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 critic.ppo_micro_batch_size_per_gpu=2
 actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048 critic.ppo_max_token_len_per_gpu=2048
 actor_rollout_ref.actor.use_kl_loss=False algorithm.use_kl_in_reward=False data.train_files="$TRAIN"
 data.val_files="$TEST" data.train_batch_size=64 data.max_prompt_length=512 data.max_response_length=512
 trainer.project_name=verl_ds_ppo_example trainer.experiment_name=qwen3_0p6b_gsm8k_ds_ppo trainer.n_gpus_per_node=2
 trainer.nnodes=1 trainer.resume_mode=disable trainer.total_training_steps="60" trainer.save_freq=0
 trainer.test_freq=-1 trainer.val_before_train=False trainer.logger='[console]'
 actor_rollout_ref.actor.deepspeed.zero_stage="2" critic.deepspeed_config.zero_stage="2"
 actor_rollout_ref.actor.deepspeed.offload="none" critic.deepspeed_config.offload="none\""""

# the script's GPU, batch and length numbers, shrunk to a CPU step of the tiny model
SMALL = {"trainer.n_gpus_per_node": "1", "data.train_batch_size": "2",
         "actor_rollout_ref.actor.ppo_mini_batch_size": "2", "critic.ppo_mini_batch_size": "2",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "1", "critic.ppo_micro_batch_size_per_gpu": "1",
         "data.max_prompt_length": "64", "data.max_response_length": "4",
         "trainer.total_training_steps": "2"}


def script(train: str, test: str, model: str = "demo", small: bool = False) -> list[str]:
    """The argument list as the shell gives it: variables expanded, quotes removed; `small`: SMALL's numbers."""
    env = {"TRAIN": train, "TEST": test, "M": model}
    args = shlex.split(re.sub(r"\$(\w+)", lambda m: env[m.group(1)], DS_PPO.replace("\n", " ")))
    return [f"{a.split('=', 1)[0]}={SMALL[a.split('=', 1)[0]]}" if small and a.split("=", 1)[0] in SMALL else a
            for a in args]


def overrides(args: list[str]) -> list[str]:
    """`args` less Hydra's config name, as the command line hands the rest to load_config."""
    from alignrl.config.verl_hydra import hydra_selection

    kept, from_config = hydra_selection(args)
    return from_config + kept


BASE = ["algorithm.adv_estimator=gae", "actor_rollout_ref.model.path=demo", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
DS = "actor_rollout_ref.actor.deepspeed."


def test_the_scripts_overrides_are_verls_deepspeed_ppo(files, capsys):
    cfg = load_config(None, overrides(script(*files)))
    t = cfg.trainer
    assert (t.strategy, t.zero_stage, t.offload, t.deepspeed_config) == ("deepspeed", 2, False, "")
    # verl's PPO: its default estimator is gae (a critic), one response a prompt
    assert (cfg.algorithm.adv_estimator, cfg.rollout.n, cfg.critic.enable) == ("gae", 1, True)
    assert cfg.critic.model_path == "demo" and cfg.model.path == "demo"
    assert (cfg.actor.ppo_mini_batch_size, cfg.actor.gradient_checkpointing, t.total_training_steps) == (32, True, 60)
    assert (t.nnodes, t.n_gpus_per_node, t.resume_mode, t.save_freq, t.test_freq) == (1, 2, "disable", 0, 0)
    err = capsys.readouterr().err
    (listed,) = [line for line in err.splitlines() if "not used on this device" in line]
    assert "trainer.use_legacy_worker_impl" in listed and "critic.model.override_config.attn_implementation" in listed
    assert "not applied" not in err  # the critic's engine is the actor's: nothing to say


@pytest.mark.parametrize("given, want", [
    (["actor@actor_rollout_ref.actor=ds_actor"], ("deepspeed", 2, False)),  # verl's engine/deepspeed.yaml
    (["+actor@actor_rollout_ref.actor=ds_actor", DS + "zero_stage=3", DS + "offload=cpu"], ("deepspeed", 3, True)),
    ([DS + "zero_stage=3", "actor@actor_rollout_ref.actor=ds_actor"], ("deepspeed", 3, False)),  # the key wins
    (["actor_rollout_ref.actor.strategy=deepspeed", "actor_rollout_ref.actor.deepspeed_config.offload=auto"],
     ("deepspeed", 2, True)),
    (["actor@actor_rollout_ref.actor=ds_actor", DS + "optimizer_offload=true"], ("deepspeed", 2, True)),
    (["actor@actor_rollout_ref.actor=dp_actor", "critic@critic=dp_critic"], ("fsdp", 2, False)),
    (["actor@actor_rollout_ref.actor=ds_actor", "actor_rollout_ref.actor.strategy=fsdp2"], ("fsdp", 2, False)),
    (["ref@actor_rollout_ref.ref=dp_ref", "rollout@actor_rollout_ref.rollout=rollout", "data=legacy_data",
      "model@actor_rollout_ref.model=hf_model", "model@critic.model=hf_model"], ("fsdp", 2, False)),
    (["actor@actor_rollout_ref.actor=ds_actor", "trainer.zero_stage=1"], ("deepspeed", 1, False)),  # alignrl's wins
])
def test_each_group_and_engine_setting(given, want, capsys):
    t = load_config(None, BASE + given).trainer
    assert (t.strategy, t.zero_stage, t.offload) == want
    assert "not applied" not in capsys.readouterr().err


@pytest.mark.parametrize("given, named", [
    # one engine trains both in alignrl: the actor's; the critic's other stage, offload or strategy is listed
    (["actor@actor_rollout_ref.actor=ds_actor", "critic=ds_critic", "critic.deepspeed_config.zero_stage=3"],
     "critic.deepspeed_config.zero_stage=3 is accepted but not applied: alignrl trains the actor and the critic with "
     "one engine, the actor's (trainer.strategy=deepspeed, trainer.zero_stage=2, trainer.offload=false)"),
    (["actor@actor_rollout_ref.actor=ds_actor", DS + "offload=cpu", "critic=ds_critic"], "critic=ds_critic is"),
    (["critic=ds_critic"], "critic=ds_critic is accepted but not applied: alignrl trains the actor and the critic "
                           "with one engine, the actor's (trainer.strategy=fsdp)"),
    ([DS + "zero_stage=3"], "DeepSpeed's settings apply to a DeepSpeed run"),
    (["actor@actor_rollout_ref.actor=ds_actor", DS + "zero_stage=1", DS + "offload=cpu"],
     f"{DS}offload=cpu is accepted but not applied: verl offloads the optimizer only from ZeRO stage 2 on"),
    (["actor@actor_rollout_ref.actor=ds_actor", DS + "offload=nvme"], "not to NVMe"),
])
def test_settings_the_run_does_not_follow_are_named_at_start(given, named, capsys):
    load_config(None, BASE + given)
    err = capsys.readouterr().err
    assert named in err and sum(named in line for line in err.splitlines()) == 1, err


@pytest.mark.parametrize("given, words", [
    ("actor@actor_rollout_ref.actor=megatron_actor", "selects verl's Megatron engine, which is not supported (alignrl "
                                                     "shards with FSDP2"),
    ("critic=megatron_critic", "verl's ds_actor / ds_critic"),
    ("critic=my_critic", "critic=my_critic is not one of verl's critic options alignrl follows: dp_critic|ds_critic"),
    ("mine@actor_rollout_ref.actor=fast", "selects a Hydra config group alignrl does not read; verl's groups it "
                                          "follows: actor@actor_rollout_ref.actor=dp_actor|ds_actor, critic="),
    ("actor@trainer=ds_actor", "actor@trainer=ds_actor selects a Hydra config group alignrl does not read"),
    ("ref@actor_rollout_ref.ref=megatron_ref", "Megatron"),
    ("actor=ds_actor", "write actor@actor_rollout_ref.actor=ds_actor"),
    (DS + "zero_stage=4", "must be a ZeRO stage: 0, 1, 2 or 3"),
    ("critic.deepspeed_config.offload=gpu", "not one of verl's offload targets: none, cpu, nvme, auto"),
    ("actor_rollout_ref.actor.strategy=megatron", "is not supported (alignrl shards with FSDP2"),
])
def test_an_unknown_group_or_option_is_one_line(given, words):
    err = one_line(BASE + [given])
    assert words in err and given.split("=")[0] in err, err


@pytest.mark.parametrize("argv", [["-cn", "ppo_trainer"], ["--config-name=ppo_trainer"],
                                  ["--config-name", "ppo_trainer.yaml"], ["-cn=ppo_trainer"]])
def test_main_ppos_own_config_name_is_accepted_silently(argv, capsys):
    from alignrl.cli import main

    assert main(["config", *argv, "actor@actor_rollout_ref.actor=ds_actor", *BASE]) == 0
    out, err = capsys.readouterr()
    assert "strategy: deepspeed" in out and "config" not in err


@pytest.mark.parametrize("argv, words", [
    (["-cn", "ppo_megatron_trainer"], "selects verl's Megatron trainer, which is not supported"),
    (["--config-name=my_trainer"], "--config-name=my_trainer: alignrl reads verl's ppo_trainer and a config of yours"),
])
def test_other_config_names_stay_one_line(argv, words, capsys):
    from alignrl.cli import main

    assert main(["config", *argv, *BASE]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_script_trains_under_deepspeed(tiny_model_dir, files, tmp_path):
    """Two PPO steps of the script, shrunk to the tiny model on the CPU (DeepSpeed's CPU accelerator), actor and
    critic under ZeRO-2. In a process of its own: one-rank DeepSpeed keeps its process group (and its rendezvous
    port) for the life of the process, which a test's worker would carry into the tests after it."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    run = run_group([sys.executable, "-m", "alignrl", "train", "ppo", *script(*files, str(tiny_model_dir), small=True),
                     "trainer.progress_bar=false", f"trainer.output_dir={tmp_path / 'out'}",
                     "trainer.logger=[console,jsonl]", "data.val_size=2"], 280, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-2000:]
    assert "PPO on 1 rank(s), strategy deepspeed" in run.stdout, run.stdout[-2000:]
    run_dir = tmp_path / "out" / "qwen3_0p6b_gsm8k_ds_ppo"  # trainer.experiment_name
    rows = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) > 0]
    assert [r["step"] for r in steps] == [1, 2] and all("critic/values_mean" in r for r in steps), steps
    ds = json.loads((run_dir / "deepspeed.json").read_text())  # the DeepSpeed config the run trained with
    assert ds["zero_optimization"] == {"stage": 2}  # ZeRO-2, nothing offloaded
    final = run_dir / "checkpoints" / "global_step_2"  # save_freq=0: the final checkpoint only
    assert (final / "model_state" / "deepspeed").is_dir() and (final / "critic_state" / "deepspeed").is_dir()
