"""Real OpenRLHF and LMM-R1 `train_ppo_ray` scripts, their flags as written (paths, the W&B key and the reward model
swapped for local ones), through every check `alignrl train ppo-ray` runs before Ray starts: the flags' own checks,
the config they translate to, the placement, the prompt data and the reward functions. No Ray cluster needed."""

import json
from dataclasses import replace

import pytest

from alignrl.compat import openrlhf_dotted as D
from alignrl.compat import openrlhf_flags as F
from alignrl.compat import openrlhf_keys as K
from alignrl.compat import openrlhf_ppo_ray as P
from alignrl.config import load_config


@pytest.fixture(scope="module")
def local(tmp_path_factory, tiny_model_dir):
    """What the scripts point at: the tiny text model, a tiny Qwen2-VL, prompt rows in the scripts' columns and an
    OpenRLHF reward file."""
    from alignrl.models.tiny_vl import build_tiny_vl

    folder = tmp_path_factory.mktemp("scripts")
    rows = [[{"role": "user", "content": f"What is {i}+1?"}] for i in range(1024)]
    data = folder / "prompts.jsonl"
    data.write_text("".join(json.dumps({"context_messages": m, "prompt": m, "label": str(i + 1),
                                        "message": json.dumps(m), "answer": str(i + 1)}) + "\n"
                            for i, m in enumerate(rows)))
    reward = folder / "reward_func.py"
    reward.write_text("import torch\n\ndef reward_func(queries, prompts, labels):\n"
                      "    return {'rewards': torch.zeros(len(queries)), 'scores': torch.zeros(len(queries))}\n")
    return {"M": str(tiny_model_dir), "VM": str(build_tiny_vl(folder / "vl", seed=0)), "D": str(data),
            "RF": str(reward), "RM": "http://127.0.0.1:5000/get_reward", "O": str(folder / "out")}


# name, command line with $-placeholders (OpenRLHF commit or LMM-R1 script it comes from)
SCRIPTS = {
    # OpenRLHF examples/scripts/train_ppo_ray_hybrid_engine.sh @17b714b: --param_dtype, dynamic batch, IS correction
    "ppo_hybrid_17b714b": "--ref_num_nodes 1 --ref_num_gpus_per_node 8 --critic_num_nodes 1 --critic_num_gpus_per_node 8 "
    "--actor_num_nodes 1 --actor_num_gpus_per_node 8 --vllm_num_engines 4 --vllm_tensor_parallel_size 2 "
    "--colocate_all_models --vllm_gpu_memory_utilization 0.5 --pretrain $M --remote_rm_url $RF --save_path $O/a "
    "--ckpt_path $O/a/ckpt --save_hf_ckpt --train_batch_size 128 --rollout_batch_size 1024 --n_samples_per_prompt 1 "
    "--max_epochs 1 --prompt_max_len 1024 --max_samples 100000 --generate_max_len 1024 --zero_stage 3 --param_dtype "
    "bf16 --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 --init_kl_coef 0.01 --prompt_data $D --input_key "
    "context_messages --apply_chat_template --normalize_reward --gradient_checkpointing --packing_samples "
    "--vllm_sync_backend nccl --enforce_eager --vllm_enable_sleep --deepspeed_enable_sleep --use_dynamic_batch "
    "--train_max_tokens_per_gpu 16384 --enable_vllm_is_correction",
    # OpenRLHF examples/scripts/train_gspo_ray_hybrid_engine.sh @5872f0c
    "gspo_5872f0c": "--ref_num_nodes 1 --ref_num_gpus_per_node 8 --actor_num_nodes 1 --actor_num_gpus_per_node 8 "
    "--vllm_num_engines 4 --vllm_tensor_parallel_size 2 --colocate_all_models --vllm_gpu_memory_utilization 0.6 "
    "--policy_loss_type gspo --advantage_estimator group_norm --gamma 1.0 --init_kl_coef 0 --pretrain $M "
    "--remote_rm_url $RM --save_path $O/b --micro_train_batch_size 8 --train_batch_size 128 "
    "--micro_rollout_batch_size 16 --rollout_batch_size 128 --n_samples_per_prompt 8 --max_epochs 1 --prompt_max_len "
    "1024 --generate_max_len 1024 --zero_stage 3 --bf16 --actor_learning_rate 5e-7 --prompt_data $D --input_key "
    "context_messages --apply_chat_template --gradient_checkpointing --packing_samples --attn_implementation "
    "flash_attention_2",
    # OpenRLHF examples/scripts/train_ppo_ray_hybrid_engine.sh in the dotted spelling (current OpenRLHF)
    "ppo_hybrid_dotted": "--ref.num_nodes 1 --ref.num_gpus_per_node 8 --critic.num_nodes 1 --critic.num_gpus_per_node 8 "
    "--actor.num_nodes 1 --actor.num_gpus_per_node 8 --vllm.num_engines 4 --vllm.tensor_parallel_size 2 "
    "--train.colocate_all --vllm.gpu_memory_utilization 0.5 --actor.model_name_or_path $M --reward.remote_url $RM "
    "--ckpt.output_dir $O/c --train.batch_size 128 --rollout.batch_size 1024 --rollout.n_samples_per_prompt 1 "
    "--data.max_len 2048 --data.max_samples 100000 --ds.zero_stage 3 --ds.param_dtype bf16 --actor.adam.lr 5e-7 "
    "--algo.kl.init_coef 0.01 --data.prompt_dataset $D --data.input_key context_messages --data.apply_chat_template "
    "--actor.eps_clip_low_high 0.2 0.27 --train.dynamic_batch_enable --train.max_tokens_per_gpu 16384 "
    "--algo.advantage.is_correction_enable",
    # OpenRLHF examples/scripts/train_vlm_math_hybrid_engine.sh @2069b3f (dotted, vision)
    "vlm_math_2069b3f": "--ref.num_nodes 1 --ref.num_gpus_per_node 4 --actor.num_nodes 1 --actor.num_gpus_per_node 4 "
    "--vllm.num_engines 4 --vllm.tensor_parallel_size 1 --train.colocate_all --algo.kl.init_coef 0 "
    "--algo.advantage.estimator reinforce_baseline --actor.model_name_or_path $VM --reward.remote_url $RM "
    "--ckpt.output_dir $O/d --train.micro_batch_size 1 --rollout.micro_batch_size 1 --train.batch_size 1024 "
    "--rollout.batch_size 128 --rollout.n_samples_per_prompt 8 --data.max_len 4096 --rollout.max_new_tokens 2048 "
    "--fsdp.param_dtype bf16 --data.prompt_dataset $D --data.input_key prompt --data.label_key label "
    "--data.image_key images --data.max_images_per_prompt 1 --actor.freeze_visual_encoder --data.apply_chat_template "
    "--fsdp.attn_implementation eager",
    # uukuguy/lmm-r1 examples/scripts/lmm_r1/train_direct_rl_geo.sh: no --train_vlm, no --apply_chat_template
    "lmm_r1_direct_rl_geo": "--ref_num_nodes 1 --ref_num_gpus_per_node 8 --remote_rm_url $RM --actor_num_nodes 1 "
    "--actor_num_gpus_per_node 8 --critic_num_nodes 1 --critic_num_gpus_per_node 8 --vllm_num_engines 8 "
    "--vllm_tensor_parallel_size 1 --colocate_all_models --vllm_enable_sleep --vllm_gpu_memory_utilization 0.5 "
    "--vllm_sync_backend gloo --enable_prefix_caching --pretrain $VM --save_path $O/e --micro_train_batch_size 2 "
    "--train_batch_size 256 --micro_rollout_batch_size 2 --rollout_batch_size 256 --temperature 1.0 "
    "--n_samples_per_prompt 16 --max_epochs 1 --num_episodes 2 --prompt_max_len 4096 --max_samples 100000 "
    "--generate_max_len 4096 --advantage_estimator gae --zero_stage 3 --bf16 --actor_learning_rate 1e-6 "
    "--init_kl_coef 0.001 --prompt_data $D --input_key message --label_key answer --normalize_reward --flash_attn "
    "--lambd 1 --gamma 1 --gradient_checkpointing --save_steps 20 --save_hf_ckpt --load_checkpoint",
}


def expand(script: str, local: dict) -> list[str]:
    out = []
    for token in script.split():
        for name in sorted(local, key=len, reverse=True):  # $VM before $M
            token = token.replace(f"${name}", local[name])
        out.append(token)
    return out


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_the_script_passes_every_check_before_ray(name, local):
    from alignrl.config.checks import check_world_size
    from alignrl.data.prompts import load_task_data
    from alignrl.placements.ray.plan import GroupLayout
    from alignrl.preference.rm import check_rl_scorers
    from alignrl.rewards.registry import check_user_fns

    argv = expand(SCRIPTS[name], local)
    args = F.parser().parse_args(D.to_underscore(argv))
    F.check(args)
    cfg = load_config(None, K.overrides(args, False, P.training_steps(args)))
    check_world_size(cfg, GroupLayout.from_flags(args).world("actor"))
    load_task_data(replace(cfg, data=replace(cfg.data, train_size=1)))
    check_rl_scorers(cfg)
    check_user_fns(cfg)
    assert all("\n" not in line for line in P.unused_lines(args, False, argv))
