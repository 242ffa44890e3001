"""The spellings of LoRA and frozen prefixes users bring (verl's keys, OpenRLHF's flags, underscore and dotted) give
alignrl's keys; --train_vlm with a text-only model and a target module that matches nothing are one line each."""

import json

import pytest

from alignrl.compat import openrlhf_flags as F
from alignrl.compat import openrlhf_keys as K
from alignrl.compat.openrlhf_dotted import DOTTED
from alignrl.config import load_config
from alignrl.config.verl_keys import translate
from alignrl.models import lora
from alignrl.models.folder import ModelError
from alignrl.models.loader import frozen_copy

FLAGS = ["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2", "--train_batch_size", "4",
         "--rollout_batch_size", "4", "--micro_train_batch_size", "1", "--actor_num_gpus_per_node", "1",
         "--ref_num_gpus_per_node", "1"]


def test_verl_lora_keys_are_model_keys():
    t = translate(["actor_rollout_ref.model.lora_rank=32", "actor_rollout_ref.model.lora_alpha=64",
                   "actor_rollout_ref.model.target_modules=[q_proj,v_proj]"])
    cfg = load_config(None, t.overrides)
    assert (cfg.model.lora_rank, cfg.model.lora_alpha) == (32, 64)
    assert lora.lora_spec(cfg.model.lora_rank, target_modules=cfg.model.target_modules).target_modules == (
        "q_proj", "v_proj")
    # verl's LoRA recipe (run_qwen2_5-3b_gsm8k_grpo_lora.sh): its memory switches are accepted and listed as unused
    recipe = translate(["actor_rollout_ref.model.lora_rank=64", "actor_rollout_ref.model.lora_alpha=32",
                        "actor_rollout_ref.model.target_modules=all-linear", "actor_rollout_ref.model.use_shm=True",
                        "actor_rollout_ref.rollout.load_format=safetensors",
                        "actor_rollout_ref.rollout.layered_summon=True", "critic.model.lora_rank=64"])
    assert load_config(None, recipe.overrides).model.lora_rank == 64
    assert "actor_rollout_ref.model.use_shm" in recipe.not_used


def test_openrlhf_lora_and_freeze_flags_are_model_and_actor_keys():
    args = F.parser().parse_args(FLAGS + ["--lora_rank", "8", "--lora_alpha", "16", "--lora_dropout", "0.05",
                                          "--target_modules", "q_proj", "v_proj", "--freeze_prefix", "visual"])
    F.check(args)
    cfg = load_config(None, K.overrides(args, gpus=False, total_steps=1))
    assert (cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.lora_dropout) == (8, 16, 0.05)
    assert list(cfg.model.target_modules) == ["q_proj", "v_proj"] and list(cfg.actor.freeze_prefix) == ["visual"]
    plain = load_config(None, K.overrides(F.parser().parse_args(FLAGS), gpus=False, total_steps=1))
    assert plain.model.lora_rank == 0 and list(plain.actor.freeze_prefix) == []
    assert DOTTED["--ds.lora.rank"] == "--lora_rank" and DOTTED["--fsdp.lora.target_modules"] == "--target_modules"


def test_train_vlm_with_a_text_only_model_is_one_line(tiny_model_dir, tmp_path):
    with pytest.raises(F.FlagError) as e:
        F.check(F.parser().parse_args(FLAGS + ["--pretrain", str(tiny_model_dir), "--train_vlm"]))
    assert "no vision_config" in str(e.value) and "\n" not in str(e.value)
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    (vlm / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "vision_config": {"depth": 2}}))
    F.check(F.parser().parse_args(FLAGS + ["--pretrain", str(vlm), "--train_vlm"]))  # accepted


def test_a_target_module_that_matches_nothing_is_one_line(tiny_model):
    with pytest.raises(ModelError) as e:
        lora.add_adapters(frozen_copy(tiny_model[0]), lora.lora_spec(4, target_modules="qkv"))
    assert "matches no module" in str(e.value) and "q_proj" in str(e.value) and "\n" not in str(e.value)
