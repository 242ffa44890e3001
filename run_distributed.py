"""The ZeroMQ pipeline's launcher: `python run_distributed.py --sampling-gpu 0 --training-gpus "1,2,3"` (one sampler,
a trainer over the listed devices). Everything lives in `alignrl.compat.zmq_launcher`."""

import sys

from alignrl.compat.zmq_launcher import launcher_main

if __name__ == "__main__":
    sys.exit(launcher_main())
