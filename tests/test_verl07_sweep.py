"""verl 0.7's current example scripts (a sweep of 18 under verl's examples/ and recipe/) run through alignrl's config:
the keys they use are translated, accepted as not used on this device, named as features alignrl lacks, or refused
in one line; and a verl-spelled run gets verl 0.7's defaults unless it uses a key only Search-R1 reads."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from alignrl.config import ConfigError, load_config
from alignrl.config.verl_keys import translate
from test_verl07_scripts import write_math

BASE = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.model.path=demo", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2"]


@pytest.fixture(autouse=True)
def _list_again(monkeypatch):
    monkeypatch.delenv("ALIGNRL_VERL_KEYS_LISTED", raising=False)  # each test sees the one-time listing


@pytest.fixture
def files(tmp_path):
    return write_math(tmp_path / "train.parquet"), write_math(tmp_path / "test.parquet")


def one_line(args: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, args)
    assert "\n" not in str(e.value)
    return str(e.value)


# ------------------------------------------------------------------------------------------ the sweep's scripts

# Everything after `python3 -m verl.trainer.main_ppo` in four of the sweep's scripts (GRPO with merged LoRA, PPO with
# a reward model, GSPO, DAPO through main_ppo), cut to the keys this file is about, with the shell's variables
# ($TRAIN, $TEST: data; $M: the model; $RM: the reward model) as the test fills them in. The DAPO line also carries
# the rollout correction of the sweep's DAPO + rollout-correction recipe and verl's default test_freq=-1.
LORA_MERGE = """algorithm.adv_estimator=grpo trainer.val_before_train=True data.train_files=$TRAIN data.val_files=$TEST
 data.train_batch_size=128 data.max_prompt_length=1024 data.max_response_length=1024 data.filter_overlong_prompts=True
 data.truncation='error' data.shuffle=False actor_rollout_ref.model.path=$M actor_rollout_ref.model.use_remove_padding=True
 actor_rollout_ref.model.enable_gradient_checkpointing=True +actor_rollout_ref.model.lora.merge=True
 actor_rollout_ref.model.lora_rank=32 actor_rollout_ref.model.lora_alpha=64 actor_rollout_ref.actor.optim.lr=1.0e-05
 actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_mini_batch_size=64
 actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576 actor_rollout_ref.actor.use_kl_loss=True
 actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0
 actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.actor.fsdp_config.model_dtype=bf16
 actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
 actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.load_format=safetensors
 actor_rollout_ref.rollout.layered_summon=True actor_rollout_ref.ref.strategy=fsdp2 algorithm.use_kl_in_reward=False
 trainer.use_legacy_worker_impl=disable trainer.critic_warmup=0 trainer.logger='["console","tensorboard","file"]'
 trainer.project_name=verl_grpo_example_gsm8k trainer.experiment_name=qwen3_4b_grpo-lora-merged
 trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=1"""

PPO_RM = """algorithm.adv_estimator=gae data.train_files="['$TRAIN']" data.val_files="['$TEST']" data.train_batch_size=1024
 data.max_prompt_length=1024 data.max_response_length=512 data.return_raw_chat=True actor_rollout_ref.model.path="$M"
 actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=256
 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 actor_rollout_ref.actor.use_kl_loss=False
 critic.optim.lr=1e-5 critic.optim.lr_warmup_steps_ratio=0.05 critic.model.path="$M" critic.ppo_micro_batch_size_per_gpu=32
 reward_model.enable=True reward_model.model_path="$RM" reward_model.use_reward_loop=True
 reward_model.inference.name=vllm reward_model.inference.gpu_memory_utilization=0.8 reward_model.inference.tensor_model_parallel_size=1
 reward_model.inference.prompt_length=2048 reward_model.inference.response_length=1024 reward_model.num_workers=8
 algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger='["console","wandb"]' trainer.val_before_train=False
 trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15"""

GSPO = """algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False actor_rollout_ref.actor.policy_loss.loss_mode=gspo
 actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean actor_rollout_ref.actor.clip_ratio_low=3e-4
 actor_rollout_ref.actor.clip_ratio_high=4e-4 actor_rollout_ref.actor.clip_ratio_c=10.0 data.train_files="['$TRAIN']"
 data.val_files="['$TEST']" data.train_batch_size=512 data.max_prompt_length=2048 data.max_response_length=8192
 actor_rollout_ref.model.path="$M" actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=128
 actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20480
 actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.rollout.mode=async
 actor_rollout_ref.rollout.n=16 trainer.balance_batch=True trainer.critic_warmup=0 trainer.logger='["console","wandb"]'
 trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=10 trainer.total_epochs=10"""

DAPO_MAIN_PPO = """data.train_files="$TRAIN" data.val_files="$TEST" data.prompt_key=prompt data.truncation='left'
 data.max_prompt_length=2048 data.max_response_length=8192 data.train_batch_size=512 actor_rollout_ref.rollout.n=16
 algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False algorithm.kl_ctrl.kl_coef=0.0
 actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28
 actor_rollout_ref.actor.clip_ratio_c=10.0 +actor_rollout_ref.model.override_config.max_position_embeddings=32768
 actor_rollout_ref.model.path="$M" actor_rollout_ref.actor.ppo_mini_batch_size=32
 actor_rollout_ref.actor.ulysses_sequence_parallel_size=4
 reward_model.reward_manager=dapo +reward_model.reward_kwargs.overlong_buffer_cfg.enable=True
 +reward_model.reward_kwargs.overlong_buffer_cfg.len=4096 +reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0
 +reward_model.reward_kwargs.overlong_buffer_cfg.log=False +reward_model.reward_kwargs.max_resp_len=8192
 algorithm.rollout_correction.rollout_is=token algorithm.rollout_correction.rollout_is_threshold=2.0
 actor_rollout_ref.rollout.calculate_log_probs=True trainer.logger=['console','wandb'] trainer.n_gpus_per_node="8"
 trainer.nnodes="8" trainer.test_freq=-1 trainer.save_freq=10 trainer.total_training_steps=200 trainer.log_val_generations=10"""


def script(text: str, train: str, test: str) -> list[str]:
    """The argument list as the shell gives it: variables expanded, quotes removed."""
    env = {"TRAIN": train, "TEST": test, "M": "demo", "RM": "rm_folder"}
    return shlex.split(re.sub(r"\$(\w+)", lambda m: env[m.group(1)], text.replace("\n", " ")))


def test_the_sweeps_scripts_translate(files, capsys, monkeypatch):
    train, test = files
    lora = load_config(None, script(LORA_MERGE, train, test))
    assert (lora.model.lora_rank, lora.trainer.logger) == (32, ["console", "tensorboard", "jsonl"])  # verl's file
    ppo = load_config(None, script(PPO_RM, train, test))
    assert ppo.algorithm.reward_model == "rm_folder" and ppo.critic.enable  # current verl's reward_model.model_path
    gspo = load_config(None, script(GSPO, train, test))
    assert (gspo.actor.policy_loss, gspo.actor.clip_ratio_c, gspo.actor.loss_agg_mode) == \
        ("gspo", 0.0, "seq-mean-token-mean")  # verl's GSPO loss reads no clip_ratio_c
    monkeypatch.delenv("ALIGNRL_VERL_KEYS_LISTED")  # listed once a launch: this load is a launch of its own
    capsys.readouterr()
    dapo = load_config(None, script(DAPO_MAIN_PPO, train, test))
    a = dapo.algorithm
    assert (a.overlong_buffer_len, a.overlong_penalty_factor, a.rollout_is, a.rollout_is_threshold) == \
        (4096, 1.0, "token", 2.0)
    assert (a.rollout_is_mode, dapo.trainer.test_freq, dapo.actor.clip_ratio_c) == ("truncate", 0, 10.0)
    err = capsys.readouterr().err
    listed = [line for line in err.splitlines() if "not used on this device" in line]
    assert len(listed) == 1 and "override_config.max_position_embeddings" in listed[0], err
    assert "calculate_log_probs" in listed[0] and "log_val_generations" not in err  # applied: verl's key
    assert dapo.trainer.log_val_generations == 10
    assert "max_resp_len" not in err  # the same as data.max_response_length: nothing to say


# ----------------------------------------------------------------------------------------- keys, one by one

NOT_USED_KEYS = [
    "trainer.balance_batch=True", "actor_rollout_ref.rollout.enable_sleep_mode=True",
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=2048",
    "actor_rollout_ref.rollout.update_weights_bucket_megabytes=512", "actor_rollout_ref.rollout.multi_stage_wake_up=True",
    "actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache=True",
    "actor_rollout_ref.rollout.trace.token2text=False", "actor_rollout_ref.rollout.cudagraph_capture_sizes=[1,2]",
    "actor_rollout_ref.rollout.max_model_len=512", "actor_rollout_ref.rollout.disable_log_stats=False",
    "actor_rollout_ref.rollout.calculate_log_probs=True", "actor_rollout_ref.rollout.agent.num_workers=8",
    "actor_rollout_ref.model.use_fused_kernels=True", "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton",
    "actor_rollout_ref.model.enable_activation_offload=True", "actor_rollout_ref.model.use_liger=True",
    "actor_rollout_ref.actor.entropy_checkpointing=True", "actor_rollout_ref.ref.entropy_from_logits_with_chunking=True",
    "actor_rollout_ref.actor.use_torch_compile=False", "actor_rollout_ref.nccl_timeout=1200",
    "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer]", "actor_rollout_ref.actor.profiler.enable=True",
    "global_profiler.tool=nsys", "+ray_kwargs.ray_init.num_cpus=8", "trainer.use_legacy_worker_impl=disable",
    "trainer.ray_wait_register_center_timeout=300", "trainer.esi_redundant_time=0",
    "data.dataloader_num_workers=8", "data.use_shm=True", "data.return_full_prompt=True", "data.validation_shuffle=False",
    "critic.fsdp.param_offload=True", "actor_rollout_ref.actor.fsdp.optimizer_offload=True",
    "reward_model.inference.gpu_memory_utilization=0.8", "+actor_rollout_ref.model.lora.merge=True",
    "+actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2",
    "+critic.model.override_config.max_position_embeddings=32768",
]


def test_settings_of_memory_speed_and_logging_are_listed_once_as_not_used(capsys):
    cfg = load_config(None, BASE + NOT_USED_KEYS + ["trainer.balance_batch=False"])
    assert cfg.rollout.n == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "not used on this device" in line]
    for item in NOT_USED_KEYS:
        key = item.split("=", 1)[0].lstrip("+")
        assert line.count(key + ",") + line.endswith(key) == 1, key  # each key once, whatever it was given


def test_a_negative_test_freq_is_no_validation_during_training():
    assert load_config(None, BASE + ["trainer.test_freq=-1"]).trainer.test_freq == 0
    assert load_config(None, BASE + ["trainer.test_freq=7"]).trainer.test_freq == 7


@pytest.mark.parametrize("mode, loss", [("vanilla", "ppo_clip"), ("gspo", "gspo"), ("clip_cov", "clip_cov"),
                                        ("kl_cov", "kl_cov"), ("sapo", "sapo"), ("dppo_tv", "dppo_tv")])
def test_verls_loss_modes_alignrl_has(mode, loss, capsys):
    cfg = load_config(None, BASE + [f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}",
                                    "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.0002",
                                    "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.0002",
                                    "actor_rollout_ref.actor.policy_loss.ppo_kl_coef=0.1"])
    assert cfg.actor.policy_loss == loss
    assert (cfg.actor.clip_cov_ratio, cfg.actor.kl_cov_ratio, cfg.actor.ppo_kl_coef) == (0.0002, 0.0002, 0.1)
    assert "policy_loss" not in capsys.readouterr().err  # the clip-cov / kl-cov settings: read, whatever the mode


@pytest.mark.parametrize("mode", ["bypass_mode", "unknown"])
def test_other_loss_modes_are_one_line(mode):
    error = one_line(BASE + [f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}"])
    assert f"policy_loss.loss_mode={mode} is not supported" in error and "vanilla, gspo" in error


@pytest.mark.parametrize("section", ["reward_model", "reward"])  # verl's newest reward section: reward.reward_kwargs
def test_the_overlong_buffer_through_reward_kwargs_is_the_overlong_buffer(capsys, monkeypatch, section):
    kw = f"+{section}.reward_kwargs.overlong_buffer_cfg."
    for on in ("True", "False"):
        spelt = [f"{kw}enable={on}", f"{kw}len=16", f"{kw}penalty_factor=0.5", f"{kw}log=False"]
        plain = [s.replace(kw, "reward_model.overlong_buffer.").lstrip("+") for s in spelt]
        a, b = (load_config(None, BASE + ["data.max_response_length=64"] + s).algorithm for s in (spelt, plain))
        assert (a.overlong_buffer_len, a.overlong_penalty_factor) == (b.overlong_buffer_len, b.overlong_penalty_factor)
        assert a.overlong_buffer_len == (16 if on == "True" else 0)
    capsys.readouterr()
    load_config(None, BASE + ["data.max_response_length=64", f"+{section}.reward_kwargs.max_resp_len=64"])
    assert "max_resp_len" not in capsys.readouterr().err
    monkeypatch.delenv("ALIGNRL_VERL_KEYS_LISTED", raising=False)  # a second launch
    load_config(None, BASE + ["data.max_response_length=64", f"+{section}.reward_kwargs.max_resp_len=128"])
    assert "reward_model.reward_kwargs.max_resp_len=128 is not applied: alignrl measures the overlong buffer from " \
           "the response cap, rollout.max_new_tokens=64" in capsys.readouterr().err


def test_reward_model_model_path_is_the_reward_models_folder():
    cfg = load_config(None, BASE + ["reward_model.enable=True", "reward_model.model_path=rm_folder"])
    assert cfg.algorithm.reward_model == "rm_folder"


RC = "algorithm.rollout_correction."


@pytest.mark.parametrize("given, want", [
    ([], ("none", 2.0, "none", None, None, None, False)),
    ([RC + "rollout_is=token", RC + "rollout_is_threshold=3.0"], ("token", 3.0, "none", None, None, None, False)),
    # rejection sampling beside IS, as verl: the IS weights truncated, the rejected tokens or sequences masked
    ([RC + "rollout_is=sequence", RC + "rollout_rs=sequence"], ("sequence", 2.0, "sequence", 2.0, None, None, False)),
    ([RC + "rollout_is=token", RC + "rollout_is_threshold=2.0", RC + "rollout_rs=token",
      RC + "rollout_rs_threshold=2.0", RC + "rollout_rs_threshold_lower=0.25"],
     ("token", 2.0, "token", 2.0, 0.25, None, False)),
    # and without it; the rejection bound defaults to rollout_is_threshold even where IS is off (verl's yaml)
    ([RC + "rollout_rs=token"], ("none", 2.0, "token", 2.0, None, None, False)),
    ([RC + "rollout_is_threshold=3.0", RC + "rollout_rs=geometric"],
     ("none", 2.0, "geometric", 3.0, None, None, False)),
    ([RC + "rollout_is=token", RC + "rollout_rs=token", RC + "rollout_rs_threshold=5.0"],
     ("token", 2.0, "token", 5.0, None, None, False)),
    ([RC + "rollout_is=token", RC + "rollout_is_batch_normalize=true"], ("token", 2.0, "none", None, None, None, True)),
    ([RC + "rollout_is_batch_normalize=true"], ("none", 2.0, "none", None, None, None, False)),  # no weights to scale
    ([RC + "rollout_is=token", RC + "rollout_token_veto_threshold=1e-4"],
     ("token", 2.0, "none", None, None, 1e-4, False)),
    ([RC + "rollout_token_veto_threshold=1e-4"], ("none", 2.0, "none", None, None, 1e-4, False)),  # veto alone
])
def test_rollout_correction_maps_onto_rollout_is(given, want, capsys):
    a = load_config(None, BASE + given).algorithm
    assert (a.rollout_is, a.rollout_is_threshold, a.rollout_rs, a.rollout_rs_threshold, a.rollout_rs_threshold_lower,
            a.rollout_token_veto_threshold, a.rollout_is_batch_normalize) == want
    assert a.rollout_is_mode == "truncate"
    assert "feature alignrl does not have" not in capsys.readouterr().err


# verl's bypass mode (current and older spellings): the rollout's log-probs are the old policy's, and verl's loss
@pytest.mark.parametrize("given, want", [
    ([RC + "bypass_mode=true"], ("ppo_clip", 0.2, 0.2, 10.0)),
    ([RC + "bypass_mode=true", RC + "loss_type=ppo_clip", RC + "rollout_is=sequence"], ("ppo_clip", 0.2, 0.2, 10.0)),
    ([RC + "bypass_old_logprob_for_rollout=true"], ("ppo_clip", 0.2, 0.2, 10.0)),
    ([RC + "bypass_mode=true", RC + "loss_type=reinforce"], ("gpg", 0.2, 0.2, 0.0)),
    ([RC + "bypass_mode=true", RC + "use_policy_gradient=true", RC + "rollout_is=token"], ("cispo", 1.0, 1.0, 0.0)),
    ([RC + "bypass_old_logprob_for_rollout=true", RC + "use_pure_rollout_correction=true", RC + "rollout_is=token",
      RC + "rollout_is_threshold=3.0"], ("cispo", 1.0, 2.0, 0.0)),
])
def test_bypass_mode_is_the_rollouts_logprobs_and_verls_loss(given, want, capsys):
    cfg = load_config(None, BASE + ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
                                    "actor_rollout_ref.actor.clip_ratio_c=10.0"] + given)
    a = cfg.actor
    assert (a.policy_loss, a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c) == want
    assert not a.recompute_old_logprobs and cfg.algorithm.rollout_is == "none"
    assert "feature alignrl does not have" not in capsys.readouterr().err


@pytest.mark.parametrize("given, named", [
    ([RC + "bypass_mode=true", RC + "rollout_rs=seq_mean_k1", RC + "rollout_rs_threshold=0.99_1.01"],
     "rollout_rs=seq_mean_k1"),
    ([RC + "rollout_is=token", RC + "use_pure_rollout_correction=true"], "without bypass mode"),
    ([RC + "rollout_is=token", RC + "loss_type=reinforce"], "without bypass mode"),
    ([RC + "bypass_mode=true", RC + "loss_type=reinforce", RC + "rollout_is=sequence"], "sequence-level IS"),
    ([RC + "bypass_mode=true", RC + "rollout_rs=geometric", RC + "rollout_token_veto_threshold=1e-4"],
     "rollout_token_veto_threshold=1e-4"),
    ([RC + "bypass_mode=true", RC + "loss_type=reinforce", RC + "rollout_is=token",
      RC + "rollout_is_batch_normalize=true"], "in bypass mode"),
])
def test_other_rollout_corrections_are_named_at_start(given, named, capsys):
    load_config(None, BASE + given)
    features = [line for line in capsys.readouterr().err.splitlines() if "feature alignrl does not have" in line]
    assert len(features) == 1 and named in features[0], features


def test_a_bad_rollout_correction_key_is_one_line():
    assert "rollout_is=geometric is not supported" in one_line(BASE + [RC + "rollout_is=geometric"])
    # current verl's divergence options need their threshold spec, as verl's own check says
    assert "needs algorithm.rollout_rs_threshold" in one_line(BASE + [RC + "rollout_rs=seq_mean_k1"])
    assert "loss_type=pg is not supported (ppo_clip or reinforce" in one_line(BASE + [RC + "loss_type=pg"])
    veto = RC + "rollout_token_veto_threshold="
    assert "rollout_token_veto_threshold=low must be a number" in one_line(BASE + [veto + "low"])
    assert "rollout_token_veto_threshold=0.0 is out of range" in one_line(BASE + [veto + "0"])
    assert "rollout_is_threshold=0.5 must be >= 1 in bypass mode" in one_line(
        BASE + [RC + "bypass_mode=true", RC + "loss_type=reinforce", RC + "rollout_is=token",
                RC + "rollout_is_threshold=0.5"])
    assert "unknown config key 'algorithm.rollout_correction.rollout_iss'" in one_line(BASE + [RC + "rollout_iss=x"])


def test_verls_file_logger_is_jsonl():
    cfg = load_config(None, BASE + ["trainer.logger=[console,file]"])
    assert cfg.trainer.logger == ["console", "jsonl"]
    assert load_config(None, BASE + ["trainer.logger=file"]).trainer.logger == ["jsonl"]
    assert "verl's file logger is alignrl's jsonl" in one_line(["trainer.logger=[console,file]"])  # alignrl's spelling


def test_lora_excluding_the_image_tower_freezes_its_adapters():
    lora = BASE + ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.exclude_modules=.*visual.*"]
    assert load_config(None, lora).actor.freeze_prefix == ["visual"]
    # without LoRA verl does not read it: nothing frozen
    assert load_config(None, BASE + ["actor_rollout_ref.model.exclude_modules=.*visual.*"]).actor.freeze_prefix == []
    error = one_line(BASE + ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.exclude_modules=.*mlp.*"])
    assert "exclude_modules=.*mlp.* is not supported" in error and "'.*visual.*'" in error


def test_excluding_the_image_tower_of_a_text_only_model_excludes_nothing(tmp_path):
    """verl's pattern matches no module of a text-only model: nothing is frozen (a freeze prefix matching no
    parameter would fail the load)."""
    folder = tmp_path / "text"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    args = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.exclude_modules=.*visual.*"]
    text_only = [o for o in BASE if not o.startswith("actor_rollout_ref.model.path=")] + [
        f"actor_rollout_ref.model.path={folder}"]
    assert load_config(None, text_only + args).actor.freeze_prefix == []
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "vision_config": {}}))
    assert load_config(None, text_only + args).actor.freeze_prefix == ["visual"]


@pytest.mark.timeout(300)
def test_frozen_tower_adapters_leave_the_tower_as_without_them(tmp_path):
    """LoRA's up-projections start at zero: adapters that never train add nothing, so the tower is the base's."""
    from alignrl.models.loader import load_causal_lm
    from alignrl.models.tiny_vl import build_tiny_vl
    from alignrl.placements.build import trained_policy

    folder = build_tiny_vl(tmp_path / "vl", seed=0)
    cfg = load_config(None, BASE + [f"actor_rollout_ref.model.path={folder}", "actor_rollout_ref.model.lora_rank=4",
                                    "actor_rollout_ref.model.exclude_modules=.*visual.*"])
    model = trained_policy(cfg, load_causal_lm(folder), None)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and not any("visual" in n for n in trained)
    assert all(float(p.abs().max()) == 0 for n, p in model.named_parameters() if "visual" in n and "lora_B" in n)
    assert any("lora_A" in n and "visual" not in n for n in trained)


def test_trust_remote_code_is_refused_only_for_a_model_that_needs_its_own_code(tmp_path):
    shipped, custom = tmp_path / "shipped", tmp_path / "custom"
    for folder, kind in ((shipped, "qwen2"), (custom, "my_arch")):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": kind, "auto_map": {"AutoModel": "m.M"}}))
    args = ["actor_rollout_ref.model.trust_remote_code=True", "data.trust_remote_code=True"]
    assert load_config(None, BASE + args + [f"actor_rollout_ref.model.path={shipped}"]).model.path == str(shipped)
    error = one_line(BASE + args + [f"actor_rollout_ref.model.path={custom}"])
    assert "needs its own modelling code" in error and "'my_arch'" in error
    load_config(None, BASE + [f"actor_rollout_ref.model.path={custom}", "critic.model.trust_remote_code=False"])


def test_verls_tool_agent_loop_maps_to_the_tool_loop_keys(tmp_path):
    tools = tmp_path / "tool_config.yaml"
    tools.write_text("tools: []\n")
    R = "actor_rollout_ref.rollout."
    cfg = load_config(None, BASE + [f"{R}multi_turn.enable=true", f"{R}multi_turn.tool_config_path={tools}",
                                    f"{R}multi_turn.max_assistant_turns=5", f"{R}multi_turn.max_user_turns=null",
                                    f"{R}multi_turn.max_parallel_calls=2", f"{R}multi_turn.format=hermes",
                                    f"{R}multi_turn.max_tool_response_length=64",
                                    f"{R}multi_turn.tool_response_truncate_side=left"])
    a = cfg.agent
    assert (a.tool_config_path, a.max_turns, a.max_user_turns, a.max_parallel_calls, a.tool_format) == (
        str(tools), 5, 0, 2, "hermes")
    assert (a.max_tool_response_length, a.tool_response_truncate_side) == (64, "left")
    interactions = tmp_path / "interaction.yaml"
    interactions.write_text("interaction: []\n")
    assert load_config(None, BASE + [f"{R}multi_turn.interaction_config_path={interactions}"]
                       ).agent.interaction_config_path == str(interactions)
    assert "max_assistant_turns" not in " ".join(translate(BASE + [f"{R}multi_turn.max_assistant_turns=null"]).not_used)
    assert "custom agent loops" in one_line(BASE + [f"{R}agent.agent_loop_config_path=loops.yaml"])
    # verl 0.4's name of the assistant-turn limit, in its multi-turn geo3k example's config
    assert load_config(None, BASE + [f"{R}multi_turn.max_turns=5"]).agent.max_turns == 5
    for keys in (["max_turns=null", "max_assistant_turns=3"], ["max_assistant_turns=3", "max_turns=null"]):
        assert load_config(None, BASE + [f"{R}multi_turn.{k}" for k in keys]).agent.max_turns == 3


# ------------------------------------------------------------------------------------------ Hydra's selection


@pytest.mark.parametrize("argv, words", [
    (["--config-name=ppo_megatron_trainer"], "selects verl's Megatron trainer, which is not supported"),
    (["--config-name", "ppo_megatron_trainer.yaml"], "Megatron"),
    (["--config-path=config", "--config-name=gsm8k_multiturn_grpo"], "no such file config/gsm8k_multiturn_grpo.yaml"),
    (["-cn", "dapo_trainer"], "--config-name=dapo_trainer: alignrl reads verl's ppo_trainer and a config of yours"),
    (["--config-path", "recipe/config", "--config-name=ppo_trainer"], "--config-path=recipe/config"),
    (["--config-path", "recipe/config"], "without --config-name"),
])
def test_hydras_config_selection_is_one_line(argv, words, capsys):
    from alignrl.cli import main

    assert main(["config", *argv, *BASE]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert "--config" in err


def test_a_config_of_yours_that_extends_ppo_trainer_is_read_before_the_command_line(tmp_path, capsys):
    """verl's multi-turn examples: `--config-path DIR --config-name NAME` whose file extends ppo_trainer; its settings
    apply, the command line's win, and a file composing other configs is one line."""
    from alignrl.cli import main

    (tmp_path / "multiturn_grpo.yaml").write_text(
        "hydra:\n  searchpath:\n    - file://verl/trainer/config\n\ndefaults:\n  - ppo_trainer\n  - _self_\n\n"
        "data:\n  max_prompt_length: 96\n  train_batch_size: 8\n  return_raw_chat: True\n"
        "actor_rollout_ref:\n  hybrid_engine: True\n  rollout:\n    name: sglang\n"
        "    multi_turn:\n      enable: True\n      max_assistant_turns: 5\n")
    assert main(["config", f"--config-path={tmp_path}", "--config-name=multiturn_grpo", *BASE]) == 0
    out = capsys.readouterr().out
    assert "max_turns: 5" in out and "max_prompt_length: 96" in out
    assert "train_batch_size: 4" in out  # the command line's (BASE) wins over the file's 8
    (tmp_path / "composed.yaml").write_text("defaults:\n  - ppo_trainer\n  - override actor: megatron_actor\n")
    assert main(["config", "-cp", str(tmp_path), "-cn", "composed", *BASE]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "one of verl's own config groups" in err, err


def test_a_users_config_composes_configs_of_its_folder_as_hydra_does(tmp_path, capsys):
    """defaults naming a config of the same folder, a group option kept there (under its package), _self_ before or
    after them, and Hydra's optional and null entries."""
    from alignrl.cli import main

    (tmp_path / "base_run.yaml").write_text("defaults:\n  - ppo_trainer\n  - _self_\n"
                                            "data:\n  max_prompt_length: 80\n  train_batch_size: 8\n")
    (tmp_path / "rollout").mkdir()
    (tmp_path / "rollout" / "short.yaml").write_text("response_length: 24\n")
    (tmp_path / "run.yaml").write_text(
        "defaults:\n  - base_run\n  - actor_rollout_ref/rollout@actor_rollout_ref.rollout: short\n"
        "  - optional extras: none\n  - later: null\n  - _self_\n"
        "data:\n  max_prompt_length: 72\n")
    assert main(["config", "-cp", str(tmp_path), "-cn", "run", *BASE]) == 2  # the group folder is rollout/, not there
    assert "actor_rollout_ref/rollout/short.yaml, which is not there" in capsys.readouterr().err
    (tmp_path / "run.yaml").write_text(
        "defaults:\n  - base_run\n  - rollout@actor_rollout_ref.rollout: short\n"
        "  - optional extras: none\n  - later: null\n  - _self_\n"
        "data:\n  max_prompt_length: 72\n")
    assert main(["config", "-cp", str(tmp_path), "-cn", "run", *BASE]) == 0
    out = capsys.readouterr().out
    assert "max_prompt_length: 72" in out  # the file's own keys after its defaults: they win
    assert "max_response_length: 24" in out  # rollout.response_length from the group option, under its package
    (tmp_path / "first.yaml").write_text("defaults:\n  - _self_\n  - base_run\ndata:\n  max_prompt_length: 72\n")
    assert main(["config", "-cp", str(tmp_path), "-cn", "first", *BASE]) == 0
    assert "max_prompt_length: 80" in capsys.readouterr().out  # _self_ first: base_run's keys win
    (tmp_path / "loop.yaml").write_text("defaults:\n  - loop\n")
    assert main(["config", "-cp", str(tmp_path), "-cn", "loop", *BASE]) == 2
    assert "compose it again (loop -> loop)" in capsys.readouterr().err


def test_main_ppos_own_config_name_says_nothing(capsys):
    from alignrl.cli import main

    assert main(["config", "-cn", "ppo_trainer", *BASE]) == 0
    assert "rollout:" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ defaults by flavour


def test_a_verl_run_gets_verl_07s_defaults():
    cfg = load_config(None, BASE)
    a, alg = cfg.actor, cfg.algorithm
    assert (a.entropy_coeff, cfg.rollout.top_p, alg.use_kl_in_reward, a.use_kl_loss) == (0.0, 1.0, False, False)
    assert (a.clip_ratio_c, a.weight_decay, cfg.critic.weight_decay, a.loss_agg_mode) == (3.0, 0.01, 0.01, "token-mean")
    assert (cfg.trainer.max_checkpoints, cfg.trainer.strategy) == (0, "fsdp")
    gspo = load_config(None, BASE + ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"])
    assert gspo.actor.clip_ratio_c == 0.0  # verl's GSPO loss has no dual-clip
    given = load_config(None, BASE + ["critic.optim.weight_decay=0.05", "critic.optim.betas=[0.9,0.95]",
                                      "actor_rollout_ref.actor.clip_ratio_c=10"])
    assert (given.critic.weight_decay, given.critic.betas, given.actor.clip_ratio_c) == (0.05, [0.9, 0.95], 10.0)


@pytest.mark.parametrize("key", ["actor_rollout_ref.rollout.n_agent=2", "actor_rollout_ref.actor.state_masking=true",
                                 "max_turns=2", "retriever.topk=3", "algorithm.no_think_rl=false",
                                 "data.max_obs_length=100", "reward_model.retrieval_score=0"])
def test_a_search_r1_key_gets_search_r1s_defaults(key):
    cfg = load_config(None, BASE + [key])
    a = cfg.actor
    assert (a.entropy_coeff, cfg.rollout.top_p, cfg.algorithm.use_kl_in_reward, a.clip_ratio_c) == (0.001, 0.95, True, 0.0)
    assert (a.weight_decay, cfg.critic.weight_decay) == (0.01, 0.01)
    assert translate(BASE + [key]).search_r1 and not translate(BASE).search_r1
