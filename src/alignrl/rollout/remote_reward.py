"""`RemoteReward`: rewards from one reward service, or from several sharing each batch (`services.reward_url` with
comma-separated URLs, OpenRLHF's `--remote_rm_url http://a/get_reward,http://b/get_reward`).

Several services: a batch's rows are cut into contiguous shards, one per service (ceil(rows / services) rows each, the
last ones shorter or empty), as OpenRLHF shards its remote reward requests; the shards are posted at the same time,
each with its service's own timeout and retries, and their scores joined back in row order. A shard that fails stops
the batch with its service's one-line ServiceError, which names that service's URL.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import torch

from alignrl.config.checks import reward_urls
from alignrl.rollout.remote import ServiceClient, ServiceError, _rows


def reward_endpoint(url: str) -> tuple[str, str | None]:
    """(service URL, path) of a reward URL: path None for `alignrl serve reward` (no path, or /v1/score), else the
    OpenRLHF-style endpoint the URL names (a doubled slash, as in http://host:5000//get_reward, taken as one)."""
    u = urlparse(url)
    path = re.sub("/+", "/", u.path).rstrip("/")
    base = f"{u.scheme}://{u.netloc}" if u.scheme and u.netloc else url  # a malformed URL: ServiceClient says so
    return base, None if path in ("", "/v1/score") else path


def shards(n: int, count: int) -> list[tuple[int, int]]:
    """[start, end) of each service's rows: contiguous runs of ceil(n / count) rows, empty ones left out (OpenRLHF's
    `batch_size = (len(queries) + num_servers - 1) // num_servers`)."""
    size = -(-n // count) if n else 0
    return [(i * size, min(n, (i + 1) * size)) for i in range(count) if i * size < n]


class RemoteReward:
    """Rewards from a service: `alignrl serve reward`'s reward model (`/v1/score`, a URL without a path), or an
    OpenRLHF-style remote reward (a URL with its path, e.g. http://127.0.0.1:5000/get_reward): OpenRLHF's protocol,
    `{"query": [prompt + response texts], "prompts": [prompt texts], "labels": [...]}` in, `{"rewards": [...]}` out,
    the texts decoded with `tokenizer` (the policy's), chat tokens kept, as OpenRLHF's experience maker sends them.
    `url` may name several services of one protocol, separated by commas: each batch is sharded over them.
    `messages`: `alignrl serve reward --input_tokenizer` services, sent each row's prompt messages with its ids, to
    score it in the reward model's own chat template (algorithm.reward_model_retemplate)."""

    def __init__(self, url: str, timeout: float = 300.0, retries: int = 3, backoff: float = 0.5,
                 api_key: str | None = None, max_rows: int = 256, tokenizer=None, messages: bool = False):
        ends = [reward_endpoint(one) for one in reward_urls(url) or [url]]
        if len({path is None for _, path in ends}) > 1:
            raise ServiceError(f"reward URLs {url!r} mix `alignrl serve reward` services (no path) with OpenRLHF-style "
                               "endpoints (a path such as /get_reward): give services of one kind")
        self.clients = [ServiceClient(base, "reward", timeout, retries, backoff, api_key) for base, _ in ends]
        self.paths = [path for _, path in ends]
        self.client, self.path = self.clients[0], self.paths[0]  # the first service (the only one, usually)
        self.max_rows, self.tokenizer = max_rows, tokenizer
        for client in self.clients if self.path is not None else ():
            client.start = "alignrl serve reward --protocol openrlhf --dataset FILE --port {port}"
        self.takes_labels = self.path is not None  # the reward stage sends the rows' ground truth along
        if messages and self.path is not None:
            raise ServiceError(f"algorithm.reward_model_retemplate=true: the reward service {self.client.url}"
                               f"{self.path} takes texts (OpenRLHF's protocol) and templates them itself; drop the "
                               "key, or serve the model with `alignrl serve reward --input_tokenizer POLICY_FOLDER`")
        self.takes_messages = messages  # ...or the rows' prompt messages

    def _post_shard(self, i: int, body_of: Callable[[int, int], dict], start: int, end: int, key: str) -> list[float]:
        """Rows [start, end) scored by service `i`, at most max_rows a request."""
        client, path = self.clients[i], self.paths[i] or "/v1/score"
        out: list[float] = []
        for s in range(start, end, self.max_rows):
            rows = min(self.max_rows, end - s)
            got = client.request("POST", path, json=body_of(s, s + rows))
            part = got.get(key) if isinstance(got, dict) else None
            if not isinstance(part, list) or len(part) != rows:
                raise ServiceError(f"reward service at {client.url}{path} answered without a list of {rows} {key!r}; "
                                   "is it a reward service?")
            out += part
        return out

    def _post(self, body_of: Callable[[int, int], dict], n: int, key: str) -> list[float]:
        parts = shards(n, len(self.clients))
        if len(parts) <= 1:  # one service (or one shard): no thread, as a single URL always ran
            return self._post_shard(0, body_of, 0, n, key) if parts else []
        # threads: each shard waits on its own service's socket, so they overlap; results are read in shard order,
        # and the first shard (in row order) that failed raises its service's error
        with ThreadPoolExecutor(max_workers=len(parts), thread_name_prefix="reward-shard") as pool:
            futures = [pool.submit(self._post_shard, i, body_of, a, b, key) for i, (a, b) in enumerate(parts)]
            return [score for f in futures for score in f.result()]

    def score_texts(self, prompts: Sequence[str], responses: Sequence[str], labels: Sequence | None = None
                    ) -> list[float]:
        """One score per (prompt text, response text) pair (`labels`: what an OpenRLHF-style service reads)."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses; pass one response per prompt")
        if self.path is None:
            return self._post(lambda a, b: {"prompts": list(prompts[a:b]), "responses": list(responses[a:b])},
                              len(prompts), "scores")
        labels = [None if x is None else x if isinstance(x, str) else json.dumps(x) for x in labels or
                  [None] * len(prompts)]
        return self._post(lambda a, b: {"query": [p + r for p, r in zip(prompts[a:b], responses[a:b])],
                                        "prompts": list(prompts[a:b]), "labels": labels[a:b]}, len(prompts), "rewards")

    def score(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
              response_mask: torch.Tensor, labels: Sequence | None = None,
              messages: Sequence[Sequence[dict]] | None = None) -> torch.Tensor:
        """Scores (B,) of token-id rollouts: the in-process `ModelScorer.score` signature; `messages`: the rows'
        prompts as chat messages, sent along (`takes_messages`)."""
        prompts, responses = _rows(prompt_ids, prompt_mask, True), _rows(response_ids, response_mask, False)
        if self.path is None:
            def body(a: int, b: int) -> dict:
                rows = {"prompts": prompts[a:b], "responses": responses[a:b]}
                return rows if messages is None else {**rows, "messages": [list(m) for m in messages[a:b]]}

            return torch.tensor(self._post(body, len(prompts), "scores"), dtype=torch.float32)
        if self.tokenizer is None:
            raise ServiceError(f"the reward service {self.client.url}{self.path} takes texts (OpenRLHF's protocol): "
                               "give RemoteReward the policy's tokenizer")
        decode = lambda rows: self.tokenizer.batch_decode(rows, skip_special_tokens=False)  # noqa: E731
        return torch.tensor(self.score_texts(decode(prompts), decode(responses), labels), dtype=torch.float32)

    def close(self) -> None:
        for client in self.clients:
            client.close()
