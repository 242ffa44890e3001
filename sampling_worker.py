"""The ZeroMQ pipeline's sampler: `python sampling_worker.py --gpu-id 0 --data-port 5555 --sync-port 5556`.
Everything lives in the package: `alignrl.compat.zmq_pipeline` (flags) and `alignrl.placements.zmq.sampler` (also `alignrl sample ...`)."""

import sys

from alignrl.compat.zmq_pipeline import sampling_main

if __name__ == "__main__":
    sys.exit(sampling_main())
