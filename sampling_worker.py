"""Seed 004's sampler: `python sampling_worker.py --gpu-id 0 --data-port 5555 --sync-port 5556`.
Everything lives in the package: `alignrl.dist.seed004` (flags) and `alignrl.dist.sampler` (also `alignrl sample ...`)."""

import sys

from alignrl.dist.seed004 import sampling_main

if __name__ == "__main__":
    sys.exit(sampling_main())
