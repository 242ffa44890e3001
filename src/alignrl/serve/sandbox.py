"""`alignrl serve sandbox`: SandboxFusion's code-running API (`POST /run_code`), Python only, for code rewards and
verl's code tool (`sandbox_fusion_url` / `reward_model.sandbox_fusion.url`).

    POST /run_code {"code": "...", "language": "python", "stdin": "", "run_timeout": 10, "memory_limit_MB": 1024}
      -> {"status": "Success" | "Failed" | "SandboxError", "message": "", "compile_result": null,
          "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error", "execution_time", "return_code",
                         "stdout", "stderr"}, "executor_pod_name": null, "files": {}}
    bad request -> 4xx {"error": {"message": "<one line>", ...}}
    GET /health -> {"status": "healthy"} with the service header

"Success" is a run that finished with exit code 0, "Failed" any other. Each run is `rewards.code_exec.LocalRunner`'s:
a child process with resource limits, which is not isolation — run this server in a container (or use
SandboxFusion) when the code is not trusted. At most --workers runs go at once; the others wait their turn. Off
loopback it needs ALIGNRL_API_KEY, and /run_code then takes only requests that carry it as a bearer token; the
server makes itself undumpable, so that the programs, which run as its user, cannot read the key from its
/proc/<pid>/environ (root reads it anyway: run the server as another user).
Deliberately left out: languages other than Python, compiling, files in and out (`files` and `fetch_files` are
accepted only empty).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

# Module level, not inside the factory: FastAPI resolves the (string) annotation `Request` by name.
from fastapi import Request

from alignrl.rewards.code_exec import LANGUAGES, CodeRunner, LocalRunner
from alignrl.serve.common import MB, PortError, RequestError, address, bind, fail, host_error, new_app, serve

PROG = "alignrl serve sandbox"


@dataclass(frozen=True)
class Limits:
    max_timeout_s: float = 60.0  # per run; a request asking more gets this
    max_memory_mb: int = 4096
    workers: int = 2


@dataclass(frozen=True)
class RunRequest:
    code: str
    stdin: str
    timeout_s: float
    memory_mb: int
    language: str


def _number(obj: dict, key: str, default: float, cap: float) -> float:
    value = obj.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise RequestError(f"'{key}' must be a positive number of {'seconds' if 'timeout' in key else 'MiB'}", 422)
    return min(float(value), cap)


def parse_request(body: bytes, limits: Limits) -> RunRequest:
    """A /run_code body checked; RequestError with one line saying what is wrong."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        raise RequestError('body is not valid JSON; send {"code": "print(1)", "language": "python"}') from None
    if not isinstance(obj, dict):
        raise RequestError(f"body must be a JSON object with 'code', got {type(obj).__name__}", 422)
    code, stdin, language = obj.get("code"), obj.get("stdin") or "", obj.get("language") or "python"
    if not isinstance(code, str):
        raise RequestError("'code' must be a string of Python source", 422)
    if not isinstance(stdin, str) or not isinstance(language, str):
        raise RequestError("'stdin' and 'language' must be strings", 422)
    if language not in LANGUAGES:
        raise RequestError(f"language {language!r} is not run here (python only); use SandboxFusion for others", 422)
    if obj.get("files") or obj.get("fetch_files"):
        raise RequestError("'files' and 'fetch_files' are not supported; send them empty", 422)
    timeout = _number(obj, "run_timeout", 10.0, limits.max_timeout_s)
    memory = max(1, int(_number(obj, "memory_limit_MB", 1024, limits.max_memory_mb)))  # never "no limit"
    return RunRequest(code, stdin, timeout, memory, language)


def create_app(runner: CodeRunner, limits: Limits = Limits()):
    app = new_app("alignrl sandbox", "sandbox", 8 * MB, token_paths=frozenset({"/run_code"}))
    # its own pool: exactly `workers` runs at once, the others queued in arrival order (the loop's default executor
    # would cap them at its own size and share its threads with the server's other work)
    workers = ThreadPoolExecutor(max_workers=limits.workers, thread_name_prefix="sandbox-run")

    @app.post("/run_code")
    async def run_code(request: Request) -> dict:
        req = parse_request(await request.body(), limits)
        result = await asyncio.get_running_loop().run_in_executor(
            workers, runner.run, req.code, req.stdin, req.timeout_s, req.memory_mb, req.language)
        return {"status": "Success" if result.succeeded else "Failed", "message": "", "compile_result": None,
                "run_result": result.as_json(), "executor_pod_name": None, "files": {}}

    return app


def _hide_environment() -> None:
    """The programs run as this process's user, who may read /proc/<this pid>/environ (its ALIGNRL_API_KEY): a
    process that is not dumpable has those files owned by root. Linux only; elsewhere nothing changes."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4, off
    except (OSError, AttributeError):
        pass


def _parser():
    from alignrl.runtime.one_line import OneLineParser

    p = OneLineParser(prog=PROG, description="runs Python programs for code rewards and code tools "
                                             "(SandboxFusion's /run_code)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (loopback unless ALIGNRL_API_KEY is set)")
    p.add_argument("--port", type=int, default=8080, help="TCP port (SandboxFusion's is 8080)")
    p.add_argument("--workers", type=int, default=max(1, len(os.sched_getaffinity(0))),
                   help="runs at once (default: the cores this process may use)")
    p.add_argument("--max_timeout", type=float, default=60.0, help="seconds a run may take at most")
    p.add_argument("--max_memory_mb", type=int, default=4096, help="address space of a run at most, MiB")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.workers < 1 or args.max_timeout <= 0 or args.max_memory_mb < 1:
        parser.error("--workers, --max_timeout and --max_memory_mb must be positive")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port} is not a TCP port; pass 0..65535")
    problem = host_error(args.host)
    if problem:
        return fail(PROG, problem)
    try:
        sock = bind(args.host, args.port)
    except PortError as e:
        return fail(PROG, str(e))
    _hide_environment()
    limits = Limits(args.max_timeout, args.max_memory_mb, args.workers)
    ready = f"{PROG}: {args.workers} workers; ready on {address(sock)}/run_code"
    try:
        return serve(create_app(LocalRunner(), limits), sock, ready, stdout=True)
    except PortError as e:
        return fail(PROG, str(e))


if __name__ == "__main__":
    sys.exit(main())
