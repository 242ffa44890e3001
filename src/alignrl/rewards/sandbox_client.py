"""A SandboxFusion service as a `CodeRunner`: each run is one `POST <url>` ({"code", "stdin", "language",
"run_timeout", "memory_limit_MB"}), answered by SandboxFusion itself or by `alignrl serve sandbox`.

verl's sandbox_fusion_url is the endpoint itself (https://host/run_code); a bare http://host:port gets /run_code
appended. A gateway timeout (504) or a connection that fails is tried again, up to `retries` times with a growing
pause (verl retries its 504s); after that, or on any other error answer, the run stops with one line naming the
URL: a reward that silently scored every program 0 while the service is down would train on noise.
"""

from __future__ import annotations

import os
import time
from urllib.parse import urlparse

import httpx

from alignrl.rewards.code_exec import ERROR, RunResult
from alignrl.rewards.errors import RewardError

START = "start one with `alignrl serve sandbox --port 8080`"


def endpoint(url: str) -> str:
    """`url` with SandboxFusion's /run_code path when it names only the server."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise RewardError(f"sandbox URL {url!r} is not an http(s) URL; give e.g. http://127.0.0.1:8080/run_code")
    return url if parsed.path.strip("/") else url.rstrip("/") + "/run_code"


class SandboxClient:
    """Runs programs on a sandbox service (thread-safe: the code reward sends a response's cases at once)."""

    def __init__(self, url: str, retries: int = 3, slack_s: float = 10.0):
        self.url, self.retries, self.slack_s = endpoint(url), retries, slack_s
        key = os.environ.get("ALIGNRL_API_KEY")  # the services' bearer token
        self._client = httpx.Client(headers={"Authorization": f"Bearer {key}"} if key else {})

    def run(self, code: str, stdin: str = "", timeout_s: float = 10.0, memory_mb: int = 1024,
            language: str = "python") -> RunResult:
        body = {"code": code, "stdin": stdin, "language": language, "run_timeout": timeout_s,
                "compile_timeout": timeout_s, "memory_limit_MB": memory_mb, "files": {}, "fetch_files": []}
        problem = ""
        for attempt in range(self.retries):
            if attempt:
                time.sleep(attempt)  # 1 s, 2 s, ...: a busy gateway gets room
            try:
                answer = self._client.post(self.url, json=body, timeout=timeout_s + self.slack_s)
            except httpx.TimeoutException:
                raise RewardError(f"sandbox service {self.url} gave no answer within {timeout_s + self.slack_s:.0f} "
                                  "s to one run; give it more workers or lower the run timeout") from None
            except httpx.HTTPError as e:
                problem = f"cannot reach it ({type(e).__name__}); {START} or fix the URL"
                continue
            if answer.status_code == 504:
                problem = "its gateway timed out (504) on every try"
                continue
            return self._result(answer)
        raise RewardError(f"sandbox service {self.url}: {problem}")

    def _result(self, answer: httpx.Response) -> RunResult:
        if answer.status_code != 200:
            raise RewardError(f"sandbox service {self.url} answered HTTP {answer.status_code}: "
                              f"{' '.join(answer.text.split())[:200]}")
        try:
            reply = answer.json()
            run = reply.get("run_result") or {}
            if reply.get("status") == "SandboxError":
                return RunResult(ERROR, None, "", str(reply.get("message", "")), 0.0)
            return RunResult(str(run.get("status", ERROR)), run.get("return_code"), run.get("stdout") or "",
                             run.get("stderr") or "", float(run.get("execution_time") or 0.0))
        except (ValueError, AttributeError, TypeError):
            raise RewardError(f"sandbox service {self.url} did not answer in SandboxFusion's form "
                              "({\"status\", \"run_result\": {...}}); is the URL its /run_code?") from None
