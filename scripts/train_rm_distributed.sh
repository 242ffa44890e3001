#!/usr/bin/env bash
# Train the helpful reward model or the harmless cost model with DDP on NGPU local processes:
#   bash scripts/train_rm_distributed.sh helpful 8
#   bash scripts/train_rm_distributed.sh harmless 8
# Writes models/<task>_rm (HF folder + eval_results.json) and logs/training/<task>_rm.
# Without GPUs the same command runs NGPU CPU processes (gloo). Extra arguments are passed on,
# e.g. `... helpful 2 learning_rate=1e-5`. MASTER_PORT overrides the port (default 29500).
# configs/rm_config.yaml may be ours or the Safe-MM-DPO project's own (base_model_path, use_lora, ...).
set -euo pipefail
cd "$(dirname "$0")/.."

TASK="${1:-}"
NGPU="${2:-1}"
shift $(( $# < 2 ? $# : 2 ))
if [[ "$TASK" != "helpful" && "$TASK" != "harmless" ]]; then
    echo "usage: bash scripts/train_rm_distributed.sh helpful|harmless NGPU [key=value ...]" >&2
    exit 2
fi
if ! [[ "$NGPU" =~ ^[1-9][0-9]*$ ]]; then
    echo "train_rm_distributed.sh: NGPU must be a positive number, got '$NGPU'" >&2
    exit 2
fi
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then  # one process per core share, not every process on every core
    CORES="$(nproc 2>/dev/null || echo 1)"
    export OMP_NUM_THREADS=$(( CORES / NGPU > 0 ? CORES / NGPU : 1 ))
fi

# the project's environment when `make` built one, else python3 from PATH (PYTHON overrides)
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# `--nproc` checks the config, the data and the batch split over NGPU ranks in this one process first,
# then starts the ranks under torchrun's agent; a mistake is one line, not one per rank plus torchrun's report
export MASTER_PORT="${MASTER_PORT:-29500}"
exec "$PYTHON" -m src.training.train_rm --nproc "$NGPU" \
    --config configs/rm_config.yaml \
    --task "$TASK" \
    --output_dir "models/${TASK}_rm" \
    "$@"
