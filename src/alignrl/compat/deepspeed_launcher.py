"""The DeepSpeed multi-node launcher's entry points, whose files in src/ are shims over this module.

- `src/launch_vllm.py`, `src/launch_ref_model.py`: the seed's flags (`--model_path PATH --port N
  --tensor_parallel_size K`) onto `alignrl serve generate` / `alignrl serve ref`, run through the package's command
  line so that Ctrl-C and errors are one line in the script's own name. Further flags (`--max_batch`, `--dtype`,
  `--host`, ...) pass through.
- `src/train_grpo.py`: `alignrl train grpo --config <checkout>/config/nodes.yaml` under that file's name (the
  launchers start it on every rank, so `ps aux | grep train_grpo.py` finds the trainer). `--local_rank=N`, which
  DeepSpeed's launcher adds unless told `--no_local_rank`, is dropped (rank and world come from the environment);
  under `accelerate launch` with a DeepSpeed plugin, the plugin's JSON becomes `trainer.strategy=deepspeed
  trainer.deepspeed_config=<its file>`."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from alignrl.errors import FLAGS_ENV, PROGRAM_ENV


def _seed_args(prog: str, description: str, port: int, argv: list[str] | None, *engines: str):
    from alignrl.runtime.one_line import OneLineParser

    p = OneLineParser(prog=prog, description=description)
    p.add_argument("--model_path", required=True, help="Hugging Face model folder, or 'demo'")
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--tensor_parallel_size", type=int, default=1)
    if engines:
        p.add_argument("--engine", choices=engines, default=engines[0])
    return p.parse_known_args(sys.argv[1:] if argv is None else argv)


def _serve(prog: str, kind: str, args, rest: list[str]) -> int:
    from alignrl.cli import main

    os.environ[PROGRAM_ENV] = prog  # `launch_vllm.py: interrupted`, and its errors in its own name
    os.environ.setdefault(FLAGS_ENV, '{"--model": "--model_path"}')
    return main(["serve", kind, "--model", args.model_path, "--port", str(args.port),
                 "--tensor_parallel_size", str(args.tensor_parallel_size), *rest])


def launch_vllm_main(argv: list[str] | None = None) -> int:
    """vLLM when it is installed (or `--engine vllm`), else the embedded HF engine, said on stderr."""
    args, rest = _seed_args("launch_vllm.py", "Start the generation service with the seed's command line.", 8000,
                            argv, "auto", "vllm", "hf")
    engine = args.engine
    if engine == "auto":
        engine = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
        if engine == "hf":
            print("launch_vllm.py: vllm is not installed; serving with the embedded HF engine", file=sys.stderr)
    return _serve("launch_vllm.py", "generate", args, [*rest, "--engine", engine])


def train_args(argv: list[str], default_config: Path) -> list[str]:
    """The arguments of `alignrl train grpo` for train_grpo.py's."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--local_rank":
            skip = True
        elif not a.startswith("--local_rank="):
            out.append(a)
    if not any(a == "--config" or a.startswith("--config=") for a in out):
        out = ["--config", str(default_config), *out]
    # accelerate launch with a DeepSpeed plugin: train with that JSON on alignrl's DeepSpeed engine
    ds_json = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true" and ds_json:
        out += ["trainer.strategy=deepspeed", f"trainer.deepspeed_config={ds_json}"]
    return out


def train_main(default_config: Path, argv: list[str] | None = None) -> int:
    from alignrl.cli import main

    return main(["train", "grpo", *train_args(sys.argv[1:] if argv is None else argv, default_config)])


def launch_ref_main(argv: list[str] | None = None) -> int:
    args, rest = _seed_args("launch_ref_model.py", "Start the reference-model service with the seed's command "
                            "line.", 8001, argv)
    return _serve("launch_ref_model.py", "ref", args, rest)
