"""Start the reference-model service with the seed's command line.

    python src/launch_ref_model.py --model_path PATH --port 8001 --tensor_parallel_size 8 [--host H]

A thin shim over `alignrl serve ref` (alignrl.compat.deepspeed_launcher). `--tensor_parallel_size` is accepted for the seed's command
line; the reference server runs its model on one device. Like every alignrl service it binds
127.0.0.1 unless told otherwise: to be reached from the training nodes pass `--host 0.0.0.0` and set
ALIGNRL_API_KEY. Any further flags (`--micro_batch`, `--dtype`, ...) are passed through.
"""

import sys

from alignrl.compat.deepspeed_launcher import launch_ref_main

if __name__ == "__main__":
    sys.exit(launch_ref_main())
