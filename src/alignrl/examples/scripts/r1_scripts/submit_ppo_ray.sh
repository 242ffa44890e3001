#!/usr/bin/env bash
# Submits `alignrl train ppo-ray` with the two-node Ray placement to the cluster's dashboard: reference 2 nodes
# × 4 GPUs and actor 2 nodes × 4 GPUs on the same GPUs (--colocate_actor_ref), 2 rollout engines of tensor
# parallel size 4 on the other 4 GPUs of each node (16 GPUs). The xDAN-*.sh scripts beside it set the
# model, data and output paths (PRETRAIN, PROMPT_DATA, SAVE_PATH) and call it; every value below can be
# overridden by the environment.
set -euo pipefail
: "${PRETRAIN:?set PRETRAIN}" "${PROMPT_DATA:?set PROMPT_DATA}" "${SAVE_PATH:?set SAVE_PATH}"
HEAD_HOST=${HEAD_HOST:-127.0.0.1}
DASHBOARD_PORT=${RAY_DASHBOARD_PORT:-8101}

export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
# Without a dashboard answering at that address `ray job submit` ends in ~100 lines of traceback: ask it first,
# with a short timeout. Any HTTP answer counts (with token auth on, the dashboard may answer this probe 401);
# proxies are bypassed, so that a proxy's own error page does not pass for the dashboard.
URL="http://$HEAD_HOST:$DASHBOARD_PORT"
answers() {
    if command -v curl >/dev/null 2>&1; then
        curl -s -o /dev/null --noproxy '*' --connect-timeout 5 --max-time 10 "$1/api/version"
    else
        python3 -c 'import sys, urllib.error, urllib.request as r
try: r.build_opener(r.ProxyHandler({})).open(sys.argv[1] + "/api/version", timeout=10)
except urllib.error.HTTPError: pass' "$1" 2>/dev/null
    fi
}
if ! answers "$URL"; then
    echo "$0: no Ray cluster answers at $URL: start one on the head node with start_ray_cluster.sh head <host>" \
         "and run this there, or point HEAD_HOST / RAY_DASHBOARD_PORT at its dashboard (from another machine:" \
         "start the head with RAY_DASHBOARD_HOST=0.0.0.0)" >&2
    exit 2
fi
ray job submit --address="$URL" -- \
    alignrl train ppo-ray \
    --ref_num_nodes 2 --ref_num_gpus_per_node 4 \
    --actor_num_nodes 2 --actor_num_gpus_per_node 4 \
    --vllm_num_engines 2 --vllm_tensor_parallel_size 4 \
    --colocate_actor_ref \
    --pretrain "$PRETRAIN" --prompt_data "$PROMPT_DATA" --save_path "$SAVE_PATH" \
    --ckpt_path "$SAVE_PATH/checkpoints" --load_checkpoint --save_steps "${SAVE_STEPS:-20}" --max_ckpt_num 3 \
    --micro_train_batch_size "${MICRO_TRAIN_BATCH_SIZE:-1}" --train_batch_size "${TRAIN_BATCH_SIZE:-128}" \
    --micro_rollout_batch_size 2 --rollout_batch_size "${ROLLOUT_BATCH_SIZE:-64}" \
    --n_samples_per_prompt "${N_SAMPLES:-8}" --max_epochs 1 --num_episodes "${NUM_EPISODES:-1}" \
    --prompt_max_len "${PROMPT_MAX_LEN:-1024}" --generate_max_len "${GENERATE_MAX_LEN:-4096}" \
    --max_samples "${MAX_SAMPLES:-100000}" ${TOTAL_STEPS:+--total_steps "$TOTAL_STEPS"} \
    --advantage_estimator group_norm --use_kl_loss --init_kl_coef 0.001 --kl_estimator k3 \
    --actor_learning_rate "${ACTOR_LR:-5e-7}" --temperature 1.0 --top_p 1.0 \
    --zero_stage "${ZERO_STAGE:-3}" --bf16 ${ADAM_OFFLOAD:+--adam_offload} --gradient_checkpointing --flash_attn \
    --vllm_gpu_memory_utilization 0.6 --vllm_sync_backend nccl --enable_prefix_caching \
    --input_key messages --label_key answer --apply_chat_template --use_tensorboard "$SAVE_PATH/tensorboard"
