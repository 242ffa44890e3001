"""Seed 000's service launchers, `src/launch_vllm.py` and `src/launch_ref_model.py`: the seed's flags
(`--model_path PATH --port N --tensor_parallel_size K`) onto `alignrl serve generate` / `alignrl serve ref`, run
through the package's command line so that Ctrl-C and errors are one line in the script's own name. Further flags
(`--max_batch`, `--dtype`, `--host`, ...) pass through."""

from __future__ import annotations

import importlib.util
import os
import sys

from alignrl.errors import FLAGS_ENV, PROGRAM_ENV


def _seed_args(prog: str, description: str, port: int, argv: list[str] | None, *engines: str):
    from alignrl.dist.launch import OneLineParser

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


def launch_ref_main(argv: list[str] | None = None) -> int:
    args, rest = _seed_args("launch_ref_model.py", "Start the reference-model service with the seed's command "
                            "line.", 8001, argv)
    return _serve("launch_ref_model.py", "ref", args, rest)
