#!/usr/bin/env bash
# The GPU checks in one command, for a machine with one CUDA device or more (CI has none; these are skipped
# there and their CPU paths tested instead):
#   1. the tests marked gpu: packed forwards in fp32 and bf16, GRPO on the GPU in each dtype, a killed GPU run
#      resumed to identical weights, the bf16 ZeroMQ pipeline with its weights through CUDA IPC, a CPU sampler
#      fed frames by a GPU trainer (NCCL DDP too where there are two GPUs);
#   2. benchmarks/async_vs_sync.py: samples/s in-process and through the ZeroMQ pipeline, the trainer and each
#      sampler a process of its own on GPU 0 (trainer.device=auto and a sampler's default both take the GPU);
#   3. the ZeroMQ pipeline's launcher, run_distributed.py, on GPU 0: a DeepSpeed ZeRO-2 trainer (bf16 where the GPU has
#      it, an NCCL group) and a sampler, with a checkpoint.
# Each part runs under its own time limit and the next one runs whatever the last did; logs go to $LOGS.
#
#   bash scripts/gpu_check.sh                       # LOGS=gpu-check-logs PYTHON=python3 STEPS=12
set -u
PY=${PYTHON:-python3}
LOGS=${LOGS:-gpu-check-logs}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch, transformers, zmq; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'bf16', torch.cuda.is_available() and torch.cuda.is_bf16_supported(), 'transformers', transformers.__version__,
'pyzmq', zmq.__version__)" || exit 1

echo "== 1. the tests marked gpu"
timeout 300 "$PY" -m pytest -p no:cacheprovider -rs --timeout 120 -m gpu tests/test_gpu.py tests/test_runner.py 2>&1 \
    | tee "$LOGS/tests.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "== 2. benchmarks/async_vs_sync.py on the GPU"
timeout 200 "$PY" benchmarks/async_vs_sync.py --rounds 1 --steps "${STEPS:-12}" --publish-mib 0 \
    --publish-repeats 10 --timeout 100 --only in-process --only "zmq k=0" --only "zmq k=1" \
    --only "zmq k=1 x2 samplers" 2>&1 | tee "$LOGS/bench.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "== 3. run_distributed.py --sampling-gpu 0 --training-gpus 0 (DeepSpeed ZeRO-2)"
out=$(mktemp -d)
ports=$("$PY" -c "from alignrl.runtime.launch import free_ports; print(*free_ports(2))")
set -- $ports
timeout 120 "$PY" run_distributed.py --sampling-gpu 0 --training-gpus 0 --data-port "$1" --sync-port "$2" \
    --max-steps 4 --save-steps 2 --output-dir "$out" 2>&1 | tee "$LOGS/zmq_pipeline.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
find "$out" -maxdepth 4 -name "global_step_*" | sort | tee -a "$LOGS/zmq_pipeline.log"
cat deepspeed.json 2>/dev/null
rm -rf "$out"
echo "gpu_check: exit $status"
exit $status
