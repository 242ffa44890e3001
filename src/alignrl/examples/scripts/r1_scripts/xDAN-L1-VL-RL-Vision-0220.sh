#!/usr/bin/env bash
# RLOO of the vision-language model (Qwen2.5-VL-7B-Instruct) on chatml math rows whose `message` holds images, with
# LMM-R1's remote rule reward: starts `python -m openrlhf.models.remote_rm.math_verifier` (alignrl's rule-reward
# server speaking OpenRLHF's protocol: POST /get_reward, 0.5 × <think></think><answer></answer> format + math-verified
# answer, found by the prompt in the same data), waits for it, then submits `alignrl train ppo-ray` with the
# upstream flags (all models colocated: actor, reference and 8 rollout engines of TP 1 on one node's 8 GPUs; the
# vision tower frozen) and stops the reward server when the job ends. Start the cluster first
# (start_ray_cluster.sh head <host>) and run this on the head.
#
# Paths and sizes come from the environment, so the same script runs a tiny VLM on a CPU cluster (PRETRAIN=<a tiny
# Qwen2-VL folder>, DATASET=<chatml rows>, nodes started with ALIGNRL_CPU_SLOTS=8, ACTOR_NUM_NODES=2 GPUS_PER_NODE=1
# VLLM_NUM_ENGINES=2 and small batches). The reward server listens on 127.0.0.1:REWARD_PORT of this node: the
# rollouts score on the head (a cluster whose rollouts run elsewhere needs REWARD_HOST=<this node's address>, which
# then serves beyond loopback and so needs ALIGNRL_API_KEY set on every node).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
WORK_DIR=${WORK_DIR:-/data/vayu/train}
DATASET=${DATASET:-$WORK_DIR/datasets/xDAN-Agentic-openMath-r1-chatml.json}
PRETRAIN=${PRETRAIN:-$WORK_DIR/models/Qwen2.5-VL-7B-Instruct}
MODEL_CPK_NAME=${MODEL_CPK_NAME:-xDAN-L1-RL-VL-7B-Instruct}
SAVE_PATH=${SAVE_PATH:-/ckpts}
HEAD_HOST=${HEAD_HOST:-127.0.0.1}
DASHBOARD_PORT=${RAY_DASHBOARD_PORT:-8101}
REWARD_HOST=${REWARD_HOST:-127.0.0.1}
REWARD_PORT=${REWARD_PORT:-5000}
PYTHON=${PYTHON:-python3}
OUT="$SAVE_PATH/$MODEL_CPK_NAME"
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}

# Ask the dashboard first (as submit_ppo_ray.sh does): without a cluster `ray job submit` ends in a traceback, and
# the reward server would have been started for nothing.
URL="http://$HEAD_HOST:$DASHBOARD_PORT"
answers() {
    if command -v curl >/dev/null 2>&1; then
        curl -s -o /dev/null --noproxy '*' --connect-timeout 5 --max-time 10 "$1"
    else
        "$PYTHON" -c 'import sys, urllib.error, urllib.request as r
try: r.build_opener(r.ProxyHandler({})).open(sys.argv[1], timeout=10)
except urllib.error.HTTPError: pass' "$1" 2>/dev/null
    fi
}
if ! answers "$URL/api/version"; then
    echo "$0: no Ray cluster answers at $URL: start one on the head node with start_ray_cluster.sh head <host>" \
         "and run this there, or point HEAD_HOST / RAY_DASHBOARD_PORT at its dashboard" >&2
    exit 2
fi
if [[ ! -e $DATASET ]]; then
    echo "$0: DATASET $DATASET does not exist: point DATASET (or WORK_DIR) at the chatml rows" >&2
    exit 2
fi
mkdir -p "$OUT"

# the remote reward, from the repository root's module spelling (LMM-R1's)
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m openrlhf.models.remote_rm.math_verifier \
    --dataset "$DATASET" --input_key message --prompt-template chatml --host "$REWARD_HOST" --port "$REWARD_PORT" \
    > "$OUT/remote_rm.log" 2>&1 &
childpid=$!
trap 'kill $childpid 2>/dev/null || true; wait $childpid 2>/dev/null || true' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM  # the EXIT trap then stops the reward server
REWARD_URL="http://$REWARD_HOST:$REWARD_PORT"
for _ in $(seq "${REWARD_WAIT_S:-120}"); do
    answers "$REWARD_URL/health" && break
    if ! kill -0 $childpid 2>/dev/null; then
        echo "$0: the reward server stopped: $(grep -v '^\s*$' "$OUT/remote_rm.log" | tail -n 1)" >&2
        exit 2
    fi
    sleep 1
done
if ! answers "$REWARD_URL/health"; then
    echo "$0: the reward server did not answer at $REWARD_URL within ${REWARD_WAIT_S:-120} s;" \
         "see $OUT/remote_rm.log" >&2
    exit 2
fi

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
ray job submit --address="$URL" -- \
    alignrl train ppo-ray \
    --ref_num_nodes "${ACTOR_NUM_NODES:-1}" --ref_num_gpus_per_node "$GPUS_PER_NODE" \
    --remote_rm_url "$REWARD_URL/get_reward" \
    --actor_num_nodes "${ACTOR_NUM_NODES:-1}" --actor_num_gpus_per_node "$GPUS_PER_NODE" \
    --vllm_num_engines "${VLLM_NUM_ENGINES:-8}" --vllm_tensor_parallel_size 1 \
    --colocate_all_models --vllm_enable_sleep --vllm_gpu_memory_utilization 0.7 --vllm_sync_backend gloo \
    --enable_prefix_caching \
    --pretrain "$PRETRAIN" --save_path "$OUT" \
    --micro_train_batch_size "${MICRO_TRAIN_BATCH_SIZE:-2}" --train_batch_size "${TRAIN_BATCH_SIZE:-128}" \
    --micro_rollout_batch_size "${MICRO_ROLLOUT_BATCH_SIZE:-4}" --rollout_batch_size "${ROLLOUT_BATCH_SIZE:-256}" \
    --temperature 1 --n_samples_per_prompt "${N_SAMPLES:-16}" --max_epochs 1 --num_episodes "${NUM_EPISODES:-30}" \
    --prompt_max_len "${PROMPT_MAX_LEN:-4096}" --max_samples "${MAX_SAMPLES:-100000}" \
    --generate_max_len "${GENERATE_MAX_LEN:-4096}" ${TOTAL_STEPS:+--total_steps "$TOTAL_STEPS"} \
    --advantage_estimator rloo --zero_stage "${ZERO_STAGE:-3}" --bf16 \
    --actor_learning_rate "${ACTOR_LR:-1e-6}" --init_kl_coef "${INIT_KL_COEF:-0.01}" \
    --prompt_data "$DATASET" --input_key message --normalize_reward --flash_attn --gradient_checkpointing \
    --save_steps "${SAVE_STEPS:-10}" --ckpt_path "$OUT/ckpt" --save_hf_ckpt \
    --use_tensorboard "$OUT/logs" --freeze_prefix visual --train_vlm
