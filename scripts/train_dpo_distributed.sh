#!/usr/bin/env bash
# Train the Safe-MM-DPO policy with DDP on NGPU local processes:
#   bash scripts/train_dpo_distributed.sh 8
# Needs models/helpful_rm and models/harmless_rm (scripts/train_rm_distributed.sh helpful|harmless N).
# Writes models/aligned (HF folder + eval_results.json) and logs/training/safe_mm_dpo.
# Without GPUs the same command runs NGPU CPU processes (gloo). Extra arguments are passed on,
# e.g. `... 2 loss_type=sigmoid` or `... 2 λ_lr=0.05`. MASTER_PORT overrides the port (default 29501).
# configs/dpo_config.yaml may be ours or the Safe-MM-DPO project's own (λ_init, β_ori, use_lora, ...).
set -euo pipefail
cd "$(dirname "$0")/.."

NGPU="${1:-1}"
shift $(( $# < 1 ? $# : 1 ))
if ! [[ "$NGPU" =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: bash scripts/train_dpo_distributed.sh NGPU [key=value ...]" >&2
    exit 2
fi
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    CORES="$(nproc 2>/dev/null || echo 1)"
    export OMP_NUM_THREADS=$(( CORES / NGPU > 0 ? CORES / NGPU : 1 ))
fi

# the project's environment when `make` built one, else python3 from PATH (PYTHON overrides)
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# `--nproc` checks the config, the data and the batch split over NGPU ranks in this one process first,
# then starts the ranks under torchrun's agent; a mistake is one line, not one per rank plus torchrun's report
export MASTER_PORT="${MASTER_PORT:-29501}"
exec "$PYTHON" -m src.training.train_safe_mm_dpo --nproc "$NGPU" \
    --config configs/dpo_config.yaml \
    --output_dir models/aligned \
    --logging_dir logs/training/safe_mm_dpo \
    "$@"
