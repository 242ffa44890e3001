#!/usr/bin/env bash
# GRPO of the 32B instruct model on two nodes with the two-node Ray placement (actor and reference 2 nodes × 4
# GPUs, 2 rollout engines of TP 4): see submit_ppo_ray.sh. Start the cluster first (start_ray_cluster.sh
# head gpu005, then worker gpu005 on gpu004) and run this on the head. Paths come from the environment, so
# the same script runs the embedded tiny model on a CPU cluster (PRETRAIN=demo PROMPT_DATA=synthetic,
# nodes started with ALIGNRL_CPU_SLOTS=8).
set -euo pipefail
WORK_DIR=${WORK_DIR:-/data/vayu/train}
export PRETRAIN=${PRETRAIN:-$WORK_DIR/models/xDAN-L2-Qwen25-32b-Instruct}
export PROMPT_DATA=${PROMPT_DATA:-$WORK_DIR/datasets/xDAN-Agentic-openMath-r1-chatml.json}
export SAVE_PATH=${SAVE_PATH:-$WORK_DIR/checkpoints/xDAN-L2-RL-32b-Instruct-0220}
export ZERO_STAGE=${ZERO_STAGE:-3} ADAM_OFFLOAD=${ADAM_OFFLOAD-1} MICRO_TRAIN_BATCH_SIZE=${MICRO_TRAIN_BATCH_SIZE:-1}
exec "$(dirname "$0")/submit_ppo_ray.sh"
