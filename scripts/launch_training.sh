#!/usr/bin/env bash
# Single-node GRPO training (scripts/launch_training.sh): every rank on this host.
#   ./scripts/launch_training.sh [key.sub=value ...]
# Ranks: NPROC, else this host's slots in the hostfile (its line for `hostname`, localhost or 127.0.0.1,
# else the first line), else 1. More than one: torchrun on 127.0.0.1:<training.master_port>; one: a
# plain process. Each rank runs src/train_grpo.py (`alignrl train grpo --config $CONFIG`).
# Env: CONFIG (default config/nodes.yaml), HOSTFILE (default: training.hostfile of the config), NPROC,
#      ALIGNRL (the alignrl command; default .venv/bin/alignrl when present).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/alignrl_env.sh
PLAN=$("$PY" - "$CONFIG" "${HOSTFILE:-}" "${NPROC:-}" "$@" <<'PYEOF'
import socket
import sys
from pathlib import Path

from alignrl.cli import preflight
from alignrl.config import ConfigError, load_config
from alignrl.doctor import parse_hostfile
from alignrl.errors import UserError

config, hostfile, nproc, overrides = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
try:
    cfg = load_config(config, overrides)
    if not nproc:
        hostfile = hostfile or cfg.trainer.hostfile
        hosts, errors = parse_hostfile(Path(hostfile).read_text()) if hostfile and Path(hostfile).is_file() else ({}, [])
        if errors:
            raise ConfigError(f"{hostfile}: {errors[0]}")
        mine = [h for h in (socket.gethostname(), "localhost", "127.0.0.1") if h in hosts]
        nproc = str(hosts[mine[0]] if mine else next(iter(hosts.values()), 1))
    if not nproc.isdigit() or int(nproc) < 1:
        raise ConfigError(f"NPROC={nproc} is not a number of processes >= 1")
    preflight(cfg, int(nproc), reward_fn=True)
except UserError as e:
    sys.exit(f"launch_training.sh: {e}")
except KeyboardInterrupt:  # the service wait can take a while: Ctrl-C there is one line too
    sys.exit("launch_training.sh: interrupted")
print(nproc, cfg.trainer.master_port)
PYEOF
) || exit 2
read -r NPROC PORT <<< "$PLAN"
echo "single node: procs=$NPROC config=$CONFIG"
if [[ "$NPROC" == 1 ]]; then
  exec "$PY" src/train_grpo.py --config "$CONFIG" "$@"
fi
exec "$PY" -m alignrl.runtime.launch --nnodes=1 --nproc_per_node="$NPROC" --master_addr=127.0.0.1 \
  --master_port="$PORT" src/train_grpo.py --config "$CONFIG" "$@"
