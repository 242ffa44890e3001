#!/usr/bin/env bash
# Distributed GRPO training from config/nodes.yaml and config/hostfile (the DeepSpeed multi-node launcher).
#   ./scripts/launch_distributed.sh [key.sub=value ...]
# Run once, on any node: DeepSpeed's multi-node launcher (`deepspeed --hostfile ... --master_addr
# <training.master_node> --master_port <training.master_port> src/train_grpo.py ...`) starts the ranks of
# every host in the hostfile, over pdsh/ssh. A cluster needs passwordless ssh from this node to every
# host, this checkout (and its .venv) at the same path on every node, and pdsh installed here. Variables
# the ranks need travel as DeepSpeed sends them: ~/.deepspeed_env or ./.deepspeed_env (KEY=VALUE lines),
# plus this shell's ALIGNRL_*, DS_*, NCCL_*, GLOO_*, HF_*, OMP_NUM_THREADS, ... (forwarded by this script).
# A hostfile with one host runs locally (no ssh).
# Fallback without ssh: run the same command on each node with NODE_RANK=0..N-1 (rank 0 on
# training.master_node); each node then starts its own ranks with torchrun.
# Env: CONFIG (default config/nodes.yaml), HOSTFILE (default: training.hostfile of the config), NODE_RANK,
#      DS_LAUNCHER (DeepSpeed's --launcher, default pdsh), ALIGNRL (the alignrl command; default
#      .venv/bin/alignrl when present).
# The config (with the overrides), the hostfile and the batch split over all ranks are checked before
# any rank starts, so a mistake is one line here, not one per rank after the models loaded.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/alignrl_env.sh
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")   # absolute: DeepSpeed runs this path on every node
ENVFILE=$(mktemp)
trap 'rm -f "$ENVFILE"' EXIT
PLAN=$("$PY" - "$CONFIG" "${HOSTFILE:-}" "${NODE_RANK:-}" "$ENVFILE" "$@" <<'PYEOF'
import os
import socket
import sys
from pathlib import Path

from alignrl.cli import preflight
from alignrl.config import ConfigError, load_config
from alignrl.doctor import check_host, host_lines, parse_hostfile
from alignrl.errors import UserError
from alignrl.models.loader import resolve_model_path

config, hostfile, node_rank, envfile, overrides = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
try:
    if not Path(config).is_file():  # this script takes the file as CONFIG=, not as --config
        raise ConfigError(f"config file not found: {config} (set CONFIG= to the nodes.yaml to use)")
    cfg = load_config(config, overrides)
    hostfile = hostfile or cfg.trainer.hostfile
    if not hostfile or not Path(hostfile).is_file():
        raise ConfigError(f"hostfile '{hostfile or '-'}' not found; set training.hostfile in {config} or HOSTFILE=")
    hosts, errors = parse_hostfile(Path(hostfile).read_text())
    if errors or not hosts:
        raise ConfigError(f"{hostfile}: {errors[0] if errors else 'no hostname slots=N lines'}")
    slots = list(hosts.values())
    if node_rank and (not node_rank.isdigit() or int(node_rank) >= len(slots)):
        raise ConfigError(f"NODE_RANK={node_rank} but {hostfile} lists {len(slots)} node(s); use 0..{len(slots) - 1}")
    try:  # else every rank waits on the rendezvous for ever, warning about IPv6 addresses
        socket.getaddrinfo(cfg.trainer.master_addr, cfg.trainer.master_port)
    except (OSError, UnicodeError):
        raise ConfigError(f"training.master_node {cfg.trainer.master_addr} does not resolve to an address; give the "
                          "host name or IP of the node that runs rank 0") from None
    for key, path in (("models.train.path", cfg.model.path), ("critic.model_path", cfg.critic.model_path)):
        if path and path != "demo":  # the demo model is built by the first rank that needs it
            resolve_model_path(path, key=key)
    preflight(cfg, sum(slots), reward_fn=True)
    if not node_rank and len(hosts) > 1:  # DeepSpeed reaches every host by name
        lines = host_lines(Path(hostfile).read_text())
        for h in hosts:
            c = check_host(h, lines[h], hostfile)
            if not c.ok:
                raise ConfigError(c.detail)
except UserError as e:
    sys.exit(f"launch_distributed.sh: {e}")
except KeyboardInterrupt:  # the service wait can take a while: Ctrl-C there is one line too
    sys.exit("launch_distributed.sh: interrupted")
# what the remote ranks need from this shell, as DeepSpeed's env file (its own ones are read first)
keep = ("ALIGNRL_", "DS_", "OMP_NUM_THREADS", "NCCL_", "GLOO_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "TORCH_")
lines = []
for f in [os.environ.get("DS_ENV_FILE")] if os.environ.get("DS_ENV_FILE") else [
        os.path.expanduser("~/.deepspeed_env"), ".deepspeed_env"]:
    if os.path.isfile(f):
        lines += [ln.strip() for ln in open(f) if "=" in ln and ln.strip() and not ln.lstrip().startswith("#")]
lines += [f"{k}={v}" for k, v in os.environ.items()
          if k.startswith(keep) and k != "DS_ENV_FILE" and not any(c in v for c in '"$`\\\n')]
Path(envfile).write_text("".join(ln + "\n" for ln in lines))
t = cfg.trainer
print(t.master_addr, t.master_port, len(slots), slots[int(node_rank or 0)], ",".join(hosts), Path(hostfile).resolve())
PYEOF
) || exit 2
read -r MASTER PORT NNODES NPROC HOSTS HOSTFILE_ABS <<< "$PLAN"

if [[ -n "${NODE_RANK:-}" ]]; then
  # fallback: this node's ranks only, with torchrun's agent from alignrl.runtime.launch (a failed rank's own
  # message, without torchrun's report block)
  echo "nodes=$NNODES node_rank=$NODE_RANK procs_per_node=$NPROC master=$MASTER:$PORT config=$CONFIG launcher=torchrun"
  rm -f "$ENVFILE"
  exec "$PY" -m alignrl.runtime.launch --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC" \
    --master_addr="$MASTER" --master_port="$PORT" src/train_grpo.py --config "$CONFIG" "$@"
fi

if [[ "$NNODES" == 1 ]]; then
  echo "nodes=1 node_rank=0 procs_per_node=$NPROC master=$MASTER:$PORT config=$CONFIG launcher=deepspeed (local)"
else
  LAUNCHER=${DS_LAUNCHER:-pdsh}
  if [[ "$LAUNCHER" == pdsh ]] && ! command -v pdsh >/dev/null; then
    echo "launch_distributed.sh: pdsh not found on this node: install pdsh (and passwordless ssh to $HOSTS)," \
         "or run this script on each node with NODE_RANK=0..$((NNODES - 1))" >&2
    exit 2
  fi
  # pdsh starts the ranks of every host over ssh; a refusal would be DeepSpeed's traceback (other launchers, such
  # as slurm, do not ssh from this node: DeepSpeed asks the first host only)
  IFS=, read -r -a HOST_LIST <<< "$HOSTS"
  [[ "$LAUNCHER" == pdsh ]] || HOST_LIST=("${HOST_LIST[0]}")
  for h in "${HOST_LIST[@]}"; do
    if ! ssh -o PasswordAuthentication=no -o BatchMode=yes -o ConnectTimeout=10 "$h" hostname >/dev/null 2>&1; then
      echo "launch_distributed.sh: host $h is not reachable over passwordless ssh from this node (DeepSpeed's" \
           "launcher starts every host's ranks over ssh, this node's too): set up ssh keys to it, or run this" \
           "script on each node with NODE_RANK=0..$((NNODES - 1))" >&2
      exit 2
    fi
  done
  echo "nodes=$NNODES hosts=$HOSTS master=$MASTER:$PORT config=$CONFIG launcher=deepspeed ($LAUNCHER)"
fi
DS_ARGS=(--hostfile "$HOSTFILE_ABS" --master_addr "$MASTER" --master_port "$PORT" --no_local_rank)
if [[ "$NNODES" == 1 ]]; then DS_ARGS+=(--no_ssh_check); else DS_ARGS+=(--launcher "${DS_LAUNCHER:-pdsh}"); fi
# DeepSpeed's runner only waits for its launcher, which stops the ranks on Ctrl-C (rank 0 says so in one line); with
# SIGINT left on, the runner would add a KeyboardInterrupt traceback. The launcher sets its own handler.
# Ctrl-C: the ranks say so in one line; DeepSpeed's launcher then exits 1, this script 130 as the other launchers do
trap 'INTERRUPTED=1' INT
rc=0
(trap '' INT; exec env DS_ENV_FILE="$ENVFILE" "$PY" -m deepspeed.launcher.runner "${DS_ARGS[@]}" src/train_grpo.py \
  --config "$CONFIG" "$@") || rc=$?
[[ -n "${INTERRUPTED:-}" && "$rc" != 0 ]] && exit 130   # a SIGINT the run outlived changes nothing
exit "$rc"
