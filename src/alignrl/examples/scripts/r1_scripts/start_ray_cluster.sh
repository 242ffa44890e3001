#!/usr/bin/env bash
# Starts this node of a Ray cluster for `alignrl train ppo-ray`:
#
#   start_ray_cluster.sh head   HEAD_HOST    # on the head node (e.g. gpu005)
#   start_ray_cluster.sh worker HEAD_HOST    # on every other node (e.g. gpu004)
#   start_ray_cluster.sh stop                # stops what this script started on this node
#
# Ray port 8100, dashboard 8101 (non-default ports keep clear of other users' clusters), a per-user temp
# dir, usage stats off. The dashboard takes `ray job submit` without authentication, so it listens on
# 127.0.0.1 only (jobs are submitted on the head node); RAY_DASHBOARD_HOST=0.0.0.0 opens it to other
# machines, for submitting from elsewhere. GPUs: as many as `nvidia-smi -L` lists; on a node without GPUs the node offers
# ALIGNRL_CPU_SLOTS (default 8) CPU slots instead, and the driver places the flags' GPU counts as CPU
# processes. Before starting, only this user's Ray processes of this temp dir are stopped.
#
# Token authentication stays off (RAY_AUTH_MODE=disabled) unless RAY_AUTH_MODE=token is set here and
# on every node and client (with the same ~/.ray/auth_token): otherwise a token file left in ~/.ray by a
# local `ray.init()` would switch the head to tokens that the workers and `ray status` do not send.
#
# Environment overrides: RAY_PORT, RAY_DASHBOARD_PORT, RAY_DASHBOARD_HOST, RAY_TEMP_DIR, ALIGNRL_CPU_SLOTS,
# RAY (the ray executable), RAY_MIN_WORKER_PORT / RAY_MAX_WORKER_PORT (the range Ray's workers bind,
# default 10002-19999 as Ray's), and for a second node on the same machine RAY_AGENT_PORT,
# RAY_AGENT_GRPC_PORT, RAY_RUNTIME_ENV_AGENT_PORT, RAY_METRICS_PORT.
set -euo pipefail

usage() { echo "usage: $0 head|worker HEAD_HOST, or $0 stop" >&2; exit 2; }
ROLE=${1:-}
HEAD_HOST=${2:-}
[[ ($ROLE == head || $ROLE == worker) && -n $HEAD_HOST || $ROLE == stop ]] || usage

RAY=${RAY:-ray}
RAY_PORT=${RAY_PORT:-8100}
DASHBOARD_PORT=${RAY_DASHBOARD_PORT:-8101}
DASHBOARD_HOST=${RAY_DASHBOARD_HOST:-127.0.0.1}
MIN_WORKER_PORT=${RAY_MIN_WORKER_PORT:-10002}
MAX_WORKER_PORT=${RAY_MAX_WORKER_PORT:-19999}
TEMP_DIR=${RAY_TEMP_DIR:-/tmp/ray_$(id -un)}
export RAY_USAGE_STATS_ENABLED=0
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}

# Stop this user's Ray processes that run out of this temp dir, and their children (workers and agents
# rename themselves to "ray::..." and no longer show the dir); other users' processes and this user's
# other clusters are left alone.
descendants() {
    local p
    for p in "$@"; do
        echo "$p"
        descendants $(pgrep -P "$p" || true)
    done
}
# The head's Ray client server does not name the temp dir: it is found by the GCS address it serves, and only
# when this temp dir runs that GCS (a worker, or another head, on this machine must leave it alone).
client_server() {
    if pgrep -u "$(id -u)" -f -- "gcs_server .*$TEMP_DIR/.*--gcs_server_port=$RAY_PORT( |$)" >/dev/null ||
       pgrep -u "$(id -u)" -f -- "gcs_server .*--gcs_server_port=$RAY_PORT .*$TEMP_DIR/" >/dev/null; then
        pgrep -u "$(id -u)" -f -- "ray.util.client.server .*--address=[^ ]*:$RAY_PORT( |$)" || true
    fi
}
mine() { descendants $( (pgrep -u "$(id -u)" -f -- "$TEMP_DIR/"; client_server) | grep -vx "$$" || true) | sort -u; }
# Something already answers on 127.0.0.1:PORT (another user's cluster, say): Ray would fail with a traceback.
taken() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
stop_mine() {
    local pids
    pids=$(mine)
    [[ -z $pids ]] && return 0
    echo "stopping this user's Ray processes under $TEMP_DIR: $(echo $pids | tr '\n' ' ')"
    kill $pids 2>/dev/null || true
    for _ in $(seq 20); do
        pids=$(for p in $pids; do if kill -0 "$p" 2>/dev/null; then echo "$p"; fi; done)
        [[ -z $pids ]] && return 0
        sleep 0.5
    done
    kill -9 $pids 2>/dev/null || true
}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    GPUS=$(nvidia-smi -L | grep -c '^GPU')
    RESOURCES=(--num-gpus="$GPUS")
else
    GPUS=0
    RESOURCES=(--num-gpus=0 --num-cpus="${ALIGNRL_CPU_SLOTS:-8}")
fi

EXTRA=()  # expanded as ${EXTRA[@]+...}: bash before 4.4 (CentOS 7) calls an empty array unbound under set -u
[[ -n ${RAY_AGENT_PORT:-} ]] && EXTRA+=(--dashboard-agent-listen-port="$RAY_AGENT_PORT")
[[ -n ${RAY_AGENT_GRPC_PORT:-} ]] && EXTRA+=(--dashboard-agent-grpc-port="$RAY_AGENT_GRPC_PORT")
[[ -n ${RAY_RUNTIME_ENV_AGENT_PORT:-} ]] && EXTRA+=(--runtime-env-agent-port="$RAY_RUNTIME_ENV_AGENT_PORT")
[[ -n ${RAY_METRICS_PORT:-} ]] && EXTRA+=(--metrics-export-port="$RAY_METRICS_PORT")

# Ray reserves every port of the worker range on the node and fails with a traceback when a port chosen for
# another component lies in it. Checked before anything is stopped: a refused setting changes nothing.
if [[ $ROLE != stop ]]; then
    PORTS=("RAY_AGENT_PORT=${RAY_AGENT_PORT:-52365}")  # NAME=PORT, the fixed ports this node binds
    for var in RAY_AGENT_GRPC_PORT RAY_RUNTIME_ENV_AGENT_PORT RAY_METRICS_PORT; do
        [[ -n ${!var:-} ]] && PORTS+=("$var=${!var}")
    done
    [[ $ROLE == head ]] && PORTS+=("RAY_PORT=$RAY_PORT" "RAY_DASHBOARD_PORT=$DASHBOARD_PORT" "Ray client server=10001")
    for entry in "RAY_MIN_WORKER_PORT=$MIN_WORKER_PORT" "RAY_MAX_WORKER_PORT=$MAX_WORKER_PORT" "${PORTS[@]}"; do
        if ! [[ ${entry##*=} =~ ^[0-9]{1,5}$ ]]; then
            echo "$0: ${entry%=*} is '${entry##*=}', not a port number" >&2
            exit 2
        fi
    done
    for entry in "${PORTS[@]}"; do
        port=${entry##*=}
        if (( 10#$MIN_WORKER_PORT <= 10#$port && 10#$port <= 10#$MAX_WORKER_PORT )); then
            echo "$0: port $port (${entry%=*}) is in Ray's worker port range $MIN_WORKER_PORT-$MAX_WORKER_PORT:" \
                 "pick a port outside it, or move the range with RAY_MIN_WORKER_PORT / RAY_MAX_WORKER_PORT" >&2
            exit 2
        fi
    done
    # A worker started on the head's own machine with the head's temp dir would stop the head (the step below stops
    # every Ray process of this temp dir) and then wait minutes for the GCS it had just stopped.
    if [[ $ROLE == worker ]] && pgrep -u "$(id -u)" -f -- "gcs_server .*$TEMP_DIR/" >/dev/null; then
        echo "$0: this machine runs a Ray head under $TEMP_DIR, which a worker with the same temp dir would stop:" \
             "give this worker its own RAY_TEMP_DIR and free agent ports (RAY_AGENT_PORT, RAY_AGENT_GRPC_PORT," \
             "RAY_RUNTIME_ENV_AGENT_PORT, RAY_METRICS_PORT)" >&2
        exit 2
    fi
fi

mkdir -p "$TEMP_DIR"
stop_mine
[[ $ROLE == stop ]] && exit 0
if [[ $ROLE == head ]]; then
    for port in "$RAY_PORT" "$DASHBOARD_PORT"; do
        if taken "$port"; then
            echo "$0: port $port is in use (another Ray cluster?): stop it, or pick free ports with" \
                 "RAY_PORT / RAY_DASHBOARD_PORT on every node" >&2
            exit 2
        fi
    done
fi
# the node's dashboard agent takes jobs (`ray job submit`): on a taken port it fails to start, and every
# submission is then refused with "No available agent to submit job"
AGENT_PORT=${RAY_AGENT_PORT:-52365}
if taken "$AGENT_PORT"; then
    echo "$0: port $AGENT_PORT (Ray's dashboard agent) is in use (another Ray on this node?): stop it, or give" \
         "this node free ports with RAY_AGENT_PORT, RAY_AGENT_GRPC_PORT, RAY_RUNTIME_ENV_AGENT_PORT" >&2
    exit 2
fi
if [[ $ROLE == head ]]; then
    JOIN=(--head --port="$RAY_PORT" --dashboard-host="$DASHBOARD_HOST" --dashboard-port="$DASHBOARD_PORT")
else
    JOIN=(--address="$HEAD_HOST:$RAY_PORT")
fi
start_node() {
    "$RAY" start "${JOIN[@]}" --temp-dir="$TEMP_DIR" --disable-usage-stats --min-worker-port="$MIN_WORKER_PORT" \
        --max-worker-port="$MAX_WORKER_PORT" ${RESOURCES[@]+"${RESOURCES[@]}"} ${EXTRA[@]+"${EXTRA[@]}"}
}
# Ray gives a starting node a fixed 30 s to register with the GCS; on a machine busy with other work (a shared
# node, another cluster starting) it can miss that and exit ("timed out during startup"). What it left is stopped
# and it starts once more.
if ! start_node; then
    echo "$0: the $ROLE node did not start; stopping what it left and starting it once more" >&2
    stop_mine
    start_node
fi
echo "node started ($ROLE, $GPUS GPU(s)); check the cluster with:"
echo "ray status --address=$HEAD_HOST:$RAY_PORT"
if [[ $ROLE == head ]]; then
    echo "jobs go to its dashboard, listening on $DASHBOARD_HOST:$DASHBOARD_PORT (RAY_DASHBOARD_HOST)"
fi
