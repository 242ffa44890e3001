"""Clients for the HTTP services, with the interfaces of the in-process pieces they replace.

- `RemoteRolloutEngine`: `generate(prompts, SamplingParams) -> Rollout` and `load_weights`, like
  `HFRolloutEngine`, against `alignrl serve generate` (token-level endpoint, one-request weight sync).
- `RemoteRefScorer`: `logprobs(prompt_ids, prompt_mask, response_ids, response_mask) -> (B, R)`.
- `RemoteReward` (in `remote_reward`): `score(...)` on token ids like
  `models.value.ModelScorer`, or `score_texts`; against `alignrl serve reward` or, for a URL with a path
  (http://host:5000/get_reward), OpenRLHF's remote reward protocol; several comma-separated URLs share each batch.

Connection errors and 5xx answers are retried with exponential backoff a bounded number of times; 4xx
answers are the caller's mistake and fail at once. A request that got no answer in time is not sent
again: the service is busy with it, and a second copy would queue behind the first. Every failure is a `ServiceError`
(a UserError: the CLI prints it as one line) naming the URL and how to fix it.
Deliberately left out: async clients, streaming, load balancing over several servers (several reward
services split each batch in fixed shards instead).
"""

from __future__ import annotations

import http.client
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from urllib.parse import urlparse

import httpx
import torch

from alignrl.data.collate import left_pad, right_pad
from alignrl.data.images import images_to_json, prompt_images
from alignrl.data.records import Rollout
from alignrl.errors import UserError
from alignrl.interfaces import SamplingParams, derived_seed

START = {"generation": "alignrl serve generate --model PATH --port {port} (a vision-language model's with "
                        "--min_pixels/--max_pixels as the run's data.min_pixels/max_pixels)",
         "reference": "alignrl serve ref --model PATH --port {port}",
         "reward": "alignrl serve reward --model RM_PATH --port {port}"}


class ServiceError(UserError):
    """A service could not answer; `status` is the HTTP status when it answered with an error; `down`: it did not
    answer at all, or kept failing (it may come back, as opposed to a mistake in the run's settings)."""

    def __init__(self, message: str, status: int | None = None, down: bool = False):
        super().__init__(message)
        self.status, self.down = status, down

    def __reduce__(self):  # rebuilt with its fields where it crosses processes (a Ray worker's error)
        return ServiceError, (str(self), self.status, self.down)


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _message(text: str) -> str:
    try:
        body = json.loads(text)
        return _one_line(body["error"]["message"] if isinstance(body.get("error"), dict) else body)
    except (ValueError, KeyError, TypeError, AttributeError):
        return _one_line(text or "(empty body)")


class ServiceClient:
    """JSON/bytes requests to one service with bounded retries; raises ServiceError."""

    TIMEOUT_KEY = "services.timeout_s"  # the setting a "did not answer in time" line names

    def __init__(self, url: str, kind: str, timeout: float = 300.0, retries: int = 3, backoff: float = 0.25,
                 api_key: str | None = None):
        if not url.startswith(("http://", "https://")):
            raise ServiceError(f"{kind} service URL {url!r} must start with http:// or https://, "
                               "e.g. http://127.0.0.1:8000")
        self.url, self.kind, self.timeout = url.rstrip("/"), kind, timeout
        self.retries, self.backoff = max(1, int(retries)), backoff
        self.start: str | None = None  # the command that starts the service, when not START[kind]
        key = api_key if api_key is not None else os.environ.get("ALIGNRL_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                                 headers=self.headers)

    def _hint(self) -> str:
        url = urlparse(self.url)
        start = (self.start or START[self.kind]).format(port=url.port or (443 if url.scheme == "https" else 80))
        if url.hostname and url.hostname not in ("localhost", "127.0.0.1", "::1"):
            # a service started on that host without --host listens on its loopback only
            return (f"`{start} --host 0.0.0.0` on {url.hostname} with ALIGNRL_API_KEY set there and here (a "
                    f"service started without --host answers on its own machine only)")
        return f"`{start}`"

    def _attempts(self, method: str, path: str, send: Callable[[], tuple[int, str]]) -> dict:
        last, reachable = "", False
        for attempt in range(self.retries):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                status, text = send()
            except (httpx.ReadTimeout, httpx.WriteTimeout, TimeoutError) as e:  # sent, and no answer in time
                raise ServiceError(f"{self.kind} service at {self.url} did not answer {method} {path} within "
                                   f"{self.timeout:g} s ({type(e).__name__}): it is busy or stuck; raise "
                                   f"{self.TIMEOUT_KEY} or give the service more capacity") from None
            except (httpx.TransportError, OSError, http.client.HTTPException) as e:  # refused, reset
                last = _one_line(f"{type(e).__name__}: {e}")
                continue
            reachable = True
            if status >= 500:
                last = f"HTTP {status}: {_message(text)}"
                continue
            if status == 401:  # the service's message speaks to a client; this is the trainer's side of it
                raise ServiceError(f"{self.kind} service at {self.url} refused this run's bearer token (HTTP 401): set "
                                   f"ALIGNRL_API_KEY here to the key the service was started with", status)
            if status >= 400:
                raise ServiceError(f"{self.kind} service at {self.url} rejected {method} {path} "
                                   f"(HTTP {status}): {_message(text)}", status)
            try:
                return json.loads(text)
            except ValueError:
                raise ServiceError(f"{self.kind} service at {self.url} answered {path} with non-JSON; "
                                   "is another program listening on that port?") from None
        if reachable:
            raise ServiceError(f"{self.kind} service at {self.url} kept failing after {self.retries} tries "
                               f"({last}); see the service's log", down=True)
        raise ServiceError(f"{self.kind} service at {self.url} is not reachable after {self.retries} tries "
                           f"({last}): start it with {self._hint()}", down=True)

    def request(self, method: str, path: str, **kw) -> dict:
        def send() -> tuple[int, str]:
            r = self.http.request(method, path, **kw)
            return r.status_code, r.text

        return self._attempts(method, path, send)

    def post_bytes(self, path: str, body: bytes, content_type: str) -> dict:
        """POST a large body with one `sendall` from the buffer. (httpx's writer copies the unsent rest
        after every partial socket send, which makes a multi-hundred-MB body quadratic.)"""
        u = urlparse(self.url)

        def send() -> tuple[int, str]:
            cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
            conn = cls(u.hostname, u.port, timeout=self.timeout)
            try:
                conn.request("POST", u.path + path, body=body,
                             headers={**self.headers, "Content-Type": content_type, "Content-Length": str(len(body))})
                resp = conn.getresponse()
                return resp.status, resp.read().decode(errors="replace")
            finally:
                conn.close()

        return self._attempts("POST", path, send)

    def check(self, key: str) -> None:
        """GET /health with this client's tries: a service that is down, mistyped or of another kind (swapped URLs,
        named by alignrl's services in a header) is one line before a run loads its model, not after (tens of seconds
        in, as a 404). An empty 200 is healthy, as vLLM's own server answers. `key`: the setting of the URL."""
        from alignrl.wire.http_service import SERVICE_HEADER

        served: list[str | None] = []

        def send() -> tuple[int, str]:
            r = self.http.get("/health")
            served.append(r.headers.get(SERVICE_HEADER))
            return r.status_code, r.text.strip() or "{}"

        self._attempts("GET", "/health", send)
        if served and served[-1] not in (None, self.kind):
            raise ServiceError(f"{key}={self.url} is a {served[-1]} service, not a {self.kind} service: are the "
                               "service URLs swapped?")

    def close(self) -> None:
        self.http.close()


def rollout_from_rows(prompts: Sequence[Sequence[int]], n: int,
                      rows: Sequence[tuple[Sequence[int], Sequence[float], bool]], pad_id: int) -> Rollout:
    """A Rollout laid out exactly as HFRolloutEngine's: n rows per prompt, left-padded prompts,
    right-padded responses, zero log-probs on padding, each row with its prompt's images (ImagePrompt).
    rows: (token ids, log-probs, truncated)."""
    expanded = [list(p) for p in prompts for _ in range(n)]
    if len(rows) != len(expanded) or any(len(ids) != len(lps) for ids, lps, _ in rows):
        raise ServiceError(f"engine returned {len(rows)} rows for {len(expanded)} sequences, or token ids and "
                           "log-probs of different lengths; the server and client versions may not match")
    prompt_ids, prompt_mask = left_pad(expanded, pad_id)
    response_ids, response_mask = right_pad([list(r[0]) for r in rows], pad_id)
    logprobs = torch.zeros(response_ids.shape)
    for i, (ids, lps, _) in enumerate(rows):
        if ids:
            logprobs[i, :len(ids)] = torch.tensor(lps, dtype=torch.float32)
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                   response_mask=response_mask, logprobs=logprobs,
                   truncated=torch.tensor([bool(r[2]) for r in rows], dtype=torch.bool),
                   group=torch.arange(len(prompts)).repeat_interleave(n),
                   images=prompt_images([p for p in prompts for _ in range(n)]))  # the trainer's forwards read them


# the images of a request as sent (pictures as base64 PNG, or pixel rows as base64 of float32: 4/3 of 4 bytes a
# value): half of the generation service's default body limit (--max_body_mb 64), the rest left to the ids
IMAGE_BODY_BYTES = 32 << 20


def request_slices(prompts: Sequence[Sequence[int]], per_request: int,
                   image_bytes: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """[start, end) of each request's prompts: at most `per_request` whole prompts, and while prompts carry images, no
    more than IMAGE_BODY_BYTES of them in the body (always at least one prompt: one larger than that alone is the
    service's one-line 413). `image_bytes`: what each prompt's images take in the body (default: their pixel rows).
    Text prompts are cut by count alone, as they always were."""
    out, start, size = [], 0, 0
    for i, p in enumerate(prompts):
        images = getattr(p, "images", None)
        need = (image_bytes[i] if image_bytes is not None else
                0 if images is None else images.pixel_values.numel() * 16 // 3)
        if i > start and (i - start == per_request or size + need > IMAGE_BODY_BYTES):
            out.append((start, i))
            start, size = i, 0
        size += need
    return out + ([(start, len(prompts))] if len(prompts) > start else [])


def picture_forms(prompts: Sequence[Sequence[int]]) -> list[dict | None] | None:
    """Each prompt's images as pictures (`data.picture_json`, a tenth to a twentieth of the pixel rows' bytes, and
    what a vLLM service reads) when every prompt with images carries its pictures, one per grid; None otherwise (the
    images then go as pixel rows). A picture is encoded once: its PNG is kept on it as an attribute (not in Pillow's
    `info`, which crops, resizes and copies inherit), for the copies of a prompt and the turns of an episode."""
    from alignrl.data.picture_json import png_base64, pictures_to_json

    with_images = [p for p in prompts if getattr(p, "images", None) is not None]
    if not with_images or any(len(getattr(p, "pictures", ())) != len(p.images.image_grid_thw) for p in with_images):
        return None
    def encode(picture) -> str:
        if getattr(picture, PNG_ATTR, None) is None:
            setattr(picture, PNG_ATTR, png_base64(picture))
        return getattr(picture, PNG_ATTR)

    return [pictures_to_json(p, encode) for p in prompts]


PNG_ATTR = "_alignrl_png_base64"  # a picture's encoding for the generation service, kept on the picture


class RemoteRolloutEngine:
    """The RolloutEngine interface over `alignrl serve generate`."""

    def __init__(self, url: str, tokenizer, timeout: float = 600.0, retries: int = 3, backoff: float = 0.5,
                 api_key: str | None = None, max_seqs_per_request: int = 1024):
        self.client = ServiceClient(url, "generation", timeout, retries, backoff, api_key)
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.max_seqs = max_seqs_per_request
        self.last_version: int | None = None  # weight version the last rollout was sampled with
        self.pushed: int | None = None  # the version this client's last load_weights put there
        self._manifest: dict | None = None

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Rollout:
        rows: list[tuple[list[int], list[float], bool]] = []
        per_request = max(1, self.max_seqs // params.n)  # whole prompts, so each group stays in one request
        pictures = picture_forms(prompts)
        sizes = None if pictures is None else [0 if x is None else sum(map(len, x["pictures"])) for x in pictures]
        for k, (s, e) in enumerate(request_slices(prompts, per_request, sizes)):
            seed = derived_seed(params.seed, k)
            chunk = prompts[s:e]
            body = {"prompts": [[int(t) for t in p] for p in chunk], "n": params.n,
                    "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                    "max_tokens": params.max_new_tokens, "stop": list(params.stop), "seed": seed}
            # sent only when set: a server of an older release refuses fields it does not know
            if params.min_p > 0.0:
                body["min_p"] = params.min_p
            if params.repetition_penalty != 1.0:
                body["repetition_penalty"] = params.repetition_penalty
            if pictures is not None:  # a vision-language model's prompts: each with its images, or null
                body["images"] = pictures[s:e]
            elif prompt_images(chunk) is not None:
                body["images"] = [images_to_json(getattr(p, "images", None)) for p in chunk]
            out = self.client.request("POST", "/v1/generate_tokens", json=body)
            rows += [(o["token_ids"], o["logprobs"], o["finish_reason"] == "length") for o in out["outputs"]]
            self.last_version = out["weight_version"]
            self.check_version(self.last_version)
        return rollout_from_rows(prompts, params.n, rows, self.pad_id)

    def check_version(self, served: int) -> None:
        """The service samples with the weights this client pushed last: a second run pushing to the same service,
        or a restart back to its base weights, would otherwise make this run train on another policy's samples
        with nothing failing (the rollout log-probs would be that policy's too)."""
        if self.pushed is not None and served != self.pushed:
            raise ServiceError(f"generation service at {self.client.url} serves weight version {served}, not the "
                               f"{self.pushed} this run pushed last: another run pushes its weights there, or the "
                               "service restarted. Give each run a generation service of its own; the same command "
                               "resumes from the last checkpoint and pushes its weights again")

    def weight_version(self) -> int:
        return int(self.client.request("GET", "/v1/weight_version")["weight_version"])

    def manifest(self) -> dict:
        """{name: TensorSpec} of the served model, fetched once."""
        from alignrl.wire.http_weights import TensorSpec

        if self._manifest is None:
            t = self.client.request("GET", "/v1/weights_manifest")["tensors"]
            self._manifest = {n: TensorSpec(tuple(s["shape"]), s["dtype"]) for n, s in t.items()}
        return self._manifest

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> int:
        """Push every tensor in one request (cast to the served dtypes); returns the served version.
        Without `version`, the server's current version + 1."""
        from alignrl.wire.http_weights import CONTENT_TYPE, DTYPES, encode

        spec = self.manifest()
        tensors = [(n, t.detach().to(DTYPES[spec[n].dtype]) if n in spec else t.detach()) for n, t in named_tensors]
        version = self.weight_version() + 1 if version is None else int(version)
        body = encode(tensors, version)
        try:
            out = self.client.post_bytes("/v1/update_weights", body, CONTENT_TYPE)
        except ServiceError as e:  # a retried push whose first try had landed: the version is already there
            if e.status == 409 and self.weight_version() == version:
                self.pushed = version
                return version
            raise
        self.pushed = int(out["weight_version"])
        return self.pushed


def _rows(ids: torch.Tensor, mask: torch.Tensor, left: bool) -> list[list[int]]:
    """Real tokens per row: masked tokens of left-padded prompts, or response tokens up to the last
    masked position (a mask with holes keeps its positions, so results line up with the input)."""
    if left:
        return [ids[i][mask[i]].tolist() for i in range(ids.shape[0])]
    ends = torch.where(mask.any(1), mask.shape[1] - mask.long().flip(1).argmax(1), 0)
    return [ids[i, :int(e)].tolist() for i, e in enumerate(ends)]


class RemoteRefScorer:
    """Reference log-probs from `alignrl serve ref`."""

    def __init__(self, url: str, timeout: float = 300.0, retries: int = 3, backoff: float = 0.5,
                 api_key: str | None = None, max_rows: int = 256, temperature: float = 1.0):
        self.client = ServiceClient(url, "reference", timeout, retries, backoff, api_key)
        self.max_rows, self.temperature = max_rows, temperature

    def logprobs(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                 response_mask: torch.Tensor) -> torch.Tensor:
        """(B, R) log-probs of each response token given its prompt, zero where response_mask is False."""
        prompts, responses = _rows(prompt_ids, prompt_mask, True), _rows(response_ids, response_mask, False)
        out = torch.zeros(response_ids.shape)
        for s in range(0, len(prompts), self.max_rows):
            body = {"prompts": prompts[s:s + self.max_rows], "responses": responses[s:s + self.max_rows],
                    "temperature": self.temperature}
            for i, lp in enumerate(self.client.request("POST", "/v1/logprobs", json=body)["logprobs"], start=s):
                if lp:
                    out[i, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
        return out * response_mask

