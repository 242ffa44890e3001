#!/usr/bin/env bash
# Distributed GRPO training from config/nodes.yaml and config/hostfile (seed 000's launcher).
#   ./scripts/launch_distributed.sh [key.sub=value ...]
# One node: torchrun with the hostfile's slots for this host. Several nodes: run the same command on
# each with NODE_RANK=0..N-1 (rank 0 on training.master_node).
# Env: CONFIG (default config/nodes.yaml), HOSTFILE (default: training.hostfile of the config), NODE_RANK,
#      ALIGNRL (the alignrl command; default .venv/bin/alignrl when present).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-config/nodes.yaml}
if [[ -z "${ALIGNRL:-}" ]]; then
  if [[ -x .venv/bin/alignrl ]]; then ALIGNRL=.venv/bin/alignrl; else ALIGNRL=alignrl; fi
fi
PY=$(dirname "$(command -v "$ALIGNRL")")/python
[[ -x "$PY" ]] || PY=python3
read -r MASTER PORT CFG_HOSTFILE < <("$PY" - "$CONFIG" <<'PYEOF'
import sys
from alignrl.config import ConfigError, load_config
try:
    t = load_config(sys.argv[1]).trainer
except ConfigError as e:
    sys.exit(f"launch_distributed.sh: {e}")
print(t.master_addr, t.master_port, t.hostfile or "-")
PYEOF
)
HOSTFILE=${HOSTFILE:-$CFG_HOSTFILE}
if [[ "$HOSTFILE" == "-" || ! -f "$HOSTFILE" ]]; then
  echo "launch_distributed.sh: hostfile '$HOSTFILE' not found; set training.hostfile in $CONFIG or HOSTFILE=" >&2
  exit 2
fi
# hostname slots=N lines, comments after '#'
mapfile -t SLOTS < <(sed -e 's/#.*//' "$HOSTFILE" | awk 'NF {split($2, a, "="); print a[2]}')
NNODES=${#SLOTS[@]}
NODE_RANK=${NODE_RANK:-0}
NPROC=${SLOTS[$NODE_RANK]}
echo "nodes=$NNODES node_rank=$NODE_RANK procs_per_node=$NPROC master=$MASTER:$PORT config=$CONFIG"
exec "$PY" -m torch.distributed.run --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC" \
  --master_addr="$MASTER" --master_port="$PORT" -m alignrl train grpo --config "$CONFIG" "$@"
