"""A SandboxFusion service as a `CodeRunner`: each run is one `POST <url>` ({"code", "stdin", "language",
"run_timeout", "memory_limit_MB"}), answered by SandboxFusion itself or by `alignrl serve sandbox`.

verl's sandbox_fusion_url is the endpoint itself (https://host/run_code); a bare http://host:port gets /run_code
appended. A connection that cannot be made, a gateway's 502/503/504 and a service answering 5xx are tried again, up
to `retries` times with a growing pause (verl retries its 504s); after that, or on an answer that says the request is
wrong (4xx) or that the sandbox itself failed, the run stops with one line naming the URL: a reward that silently
scored every program 0 while the service is down would train on noise. A run waits for its answer up to
`wait_s` (5 minutes): a busy service queues the runs it has no worker for, and a program stops at its own time limit
there.

alignrl's bearer token (ALIGNRL_API_KEY) is sent only to `alignrl serve sandbox` (its /health says so), never to
another service.
"""

from __future__ import annotations

import os
import time
from urllib.parse import urlparse

import httpx

from alignrl.rewards.code_exec import RunResult
from alignrl.rewards.errors import RewardError

START = "start one with `alignrl serve sandbox --port 8080`"
RETRIED = (502, 503, 504)
KEY_ENV = "ALIGNRL_API_KEY"  # the alignrl services' bearer token
SERVICE = ("x-alignrl-service", "sandbox")  # the header alignrl's services answer /health with, and this one's name


def endpoint(url: str) -> str:
    """`url` with SandboxFusion's /run_code path when it names only the server."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise RewardError(f"sandbox URL {url!r} is not an http(s) URL; give e.g. http://127.0.0.1:8080/run_code")
    return url if parsed.path.strip("/") else url.rstrip("/") + "/run_code"


class SandboxClient:
    """Runs programs on a sandbox service (thread-safe: the code reward sends a response's cases at once)."""

    def __init__(self, url: str, retries: int = 3, wait_s: float = 300.0):
        self.url, self.retries, self.wait_s = endpoint(url), retries, wait_s
        self._client = httpx.Client()
        self._headers: dict[str, str] | None = None  # decided on the first run (`_auth`)

    def close(self) -> None:
        self._client.close()

    def run(self, code: str, stdin: str = "", timeout_s: float = 10.0, memory_mb: int = 1024,
            language: str = "python") -> RunResult:
        body = {"code": code, "stdin": stdin, "language": language, "run_timeout": timeout_s,
                "compile_timeout": timeout_s, "memory_limit_MB": memory_mb, "files": {}, "fetch_files": []}
        wait = httpx.Timeout(max(self.wait_s, timeout_s + 10.0), connect=10.0)
        problem = ""
        for attempt in range(self.retries):
            if attempt:
                time.sleep(attempt)  # 1 s, 2 s, ...: a busy gateway gets room
            try:
                answer = self._client.post(self.url, json=body, timeout=wait, headers=self._auth())
            except httpx.ConnectError as e:
                problem = f"cannot reach it ({type(e).__name__}); {START} or fix the URL"
                continue
            except httpx.ConnectTimeout:
                problem = f"cannot reach it (no connection within 10 s); {START} or fix the URL"
                continue
            except httpx.TimeoutException:
                raise RewardError(f"sandbox service {self.url} gave no answer within {wait.read:.0f} s to one run; "
                                  "give it more workers or send fewer runs at once (sandbox.max_concurrent)") from None
            except httpx.HTTPError as e:
                problem = f"the connection failed ({type(e).__name__}: {e})"
                continue
            if answer.status_code in RETRIED or answer.status_code >= 500:
                problem = f"it answered HTTP {answer.status_code} on every try"
                continue
            return self._result(answer)
        raise RewardError(f"sandbox service {self.url}: {problem}")

    def _auth(self) -> dict[str, str]:
        """The bearer token's header for alignrl's own sandbox service, found by its /health; none for others."""
        if self._headers is None:
            key, alignrl = os.environ.get(KEY_ENV), False
            if key:
                base = self.url.rsplit("/", 1)[0]
                try:
                    alignrl = self._client.get(f"{base}/health", timeout=10.0).headers.get(SERVICE[0]) == SERVICE[1]
                except httpx.HTTPError:
                    pass  # unreachable now: the run's own request says so
            self._headers = {"Authorization": f"Bearer {key}"} if alignrl else {}
        return self._headers

    def _result(self, answer: httpx.Response) -> RunResult:
        if answer.status_code == 401:
            raise RewardError(f"sandbox service {self.url} refused the request (401): set {KEY_ENV} here to the key "
                              "the service was started with")
        if answer.status_code != 200:
            raise RewardError(f"sandbox service {self.url} answered HTTP {answer.status_code}: "
                              f"{' '.join(answer.text.split())[:200]}")
        try:
            reply = answer.json()
            run = reply.get("run_result") or {}
            result = RunResult(str(run.get("status", "Error")), run.get("return_code"), run.get("stdout") or "",
                               run.get("stderr") or "", float(run.get("execution_time") or 0.0))
        except (ValueError, AttributeError, TypeError):
            raise RewardError(f"sandbox service {self.url} did not answer in SandboxFusion's form "
                              "({\"status\", \"run_result\": {...}}); is the URL its /run_code?") from None
        if reply.get("status") == "SandboxError":
            raise RewardError(f"sandbox service {self.url} failed to run a program (SandboxError: "
                              f"{' '.join(str(reply.get('message', '')).split())[:200]}); check the service")
        return result
