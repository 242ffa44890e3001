"""The ZeroMQ pipeline's trainer: `python training_worker.py --gpu-id 1 --data-port 5555 --sync-port 5556 [--no-deepspeed]`.
Everything lives in `alignrl.compat.zmq_pipeline` (also `alignrl train grpo pipeline.placement=zmq ...`)."""

import sys

from alignrl.compat.zmq_pipeline import training_main

if __name__ == "__main__":
    sys.exit(training_main())
