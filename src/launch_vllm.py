"""Start the generation service with the seed's command line.

    python src/launch_vllm.py --model_path PATH --port 8000 --tensor_parallel_size 8 [--host H] [--engine E]

A thin shim over `alignrl serve generate` (alignrl.compat.deepspeed_launcher): vLLM when it is installed (or `--engine vllm`), else the
embedded HF engine, said on stderr. Like every alignrl service it binds 127.0.0.1 unless told
otherwise; to be reached from the training nodes (`curl http://gpu004:8000/health`), pass
`--host 0.0.0.0` and set ALIGNRL_API_KEY (the trainer sends it when pushing weights). Any further
flags (`--max_batch`, `--dtype`, ...) are passed through.
"""

import sys

from alignrl.compat.deepspeed_launcher import launch_vllm_main

if __name__ == "__main__":
    sys.exit(launch_vllm_main())
