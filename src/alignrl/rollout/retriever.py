"""The search tool of multi-turn rollouts: a client of Search-R1's retrieval API (`alignrl serve retrieve`,
or Search-R1's own `retrieval_server.py`).

    POST <url> {"queries": [...], "topk": k, "return_scores": true}
      -> {"result": [[{"document": {"contents": "\\"Title\\"\\ntext"}, "score": s}, ...], ...]}

Each query's passages become one observation text laid out as Search-R1 shows them to the model,
`Doc 1(Title: ...) text\\nDoc 2(Title: ...) text\\n`. All the queries of one turn go in one request,
split only past the server's limits (queries and bytes per request: `alignrl serve retrieve` names its
own in /health, read at the start-up check). Connection errors and 5xx answers are retried with
backoff; every failure is one `ServiceError` line naming the URL. Deliberately left out: reranking and
caching of repeated queries.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from urllib.parse import urlparse

import httpx

from alignrl.config.checks import retriever_url_problem
from alignrl.rollout.remote import ServiceClient, ServiceError

MAX_QUERY_CHARS = 8192  # `alignrl serve retrieve` refuses longer queries; a model can write anything
MAX_QUERIES = 512  # queries per request the server accepts by default
MAX_BODY_BYTES = 4 << 20  # request body the server accepts by default


class _RetrievalService(ServiceClient):
    """The shared HTTP client, with the start hint and the timeout setting of the retrieval server."""

    TIMEOUT_KEY, URL_KEY = "retriever.timeout_s", "retriever.url"  # the settings its lines name (the client's own)

    def _hint(self) -> str:
        port = urlparse(self.url).port or 80  # a mistyped port is likelier than a server never started
        return (f"`PORT={port} bash retrieval_launch.sh` (or `alignrl serve retrieve --port {port}`), or check "
                f"{self.URL_KEY}")


def passages_text(hits: Sequence) -> str:
    """Search-R1's layout of one query's hits: `Doc i(Title: <first line>) <rest>` per line.
    A hit is `{"document": {"contents": ...}, "score": s}` or, without scores, `{"contents": ...}`."""
    return search_r1_layout(hit_contents(hits))


def search_r1_layout(contents: Sequence[str]) -> str:
    return "".join(f"Doc {i}(Title: {title}) {text}\n"
                   for i, (title, _, text) in enumerate((c.partition("\n") for c in contents), start=1))


def hit_contents(hits: Sequence) -> list[str]:
    """The `contents` text of each hit; ValueError naming the first hit without one."""
    out = []
    for i, hit in enumerate(hits, start=1):
        doc = hit.get("document", hit) if isinstance(hit, dict) else None
        contents = doc.get("contents") if isinstance(doc, dict) else None
        if not isinstance(contents, str):
            raise ValueError(f"hit {i} has no 'contents' string")
        out.append(contents)
    return out


class RetrieverClient:
    """`search(queries) -> one observation text per query` against a retrieval server."""

    def __init__(self, url: str, topk: int = 3, timeout_s: float = 30.0, retries: int = 3,
                 max_query_chars: int = MAX_QUERY_CHARS, max_queries: int = MAX_QUERIES,
                 max_body_bytes: int = MAX_BODY_BYTES,
                 keys: tuple[str, str] = ("retriever.url", "retriever.timeout_s")):
        """`keys`: the settings of the URL and the timeout, named in failures."""
        problem = retriever_url_problem(url, keys[0])
        if problem:
            raise ServiceError(problem)
        u = urlparse(url)
        self.client = _RetrievalService(f"{u.scheme}://{u.netloc}", "retrieval", timeout=timeout_s, retries=retries)
        self.client.URL_KEY, self.client.TIMEOUT_KEY = keys
        self.url, self.path = url, (u.path or "/retrieve") + (f"?{u.query}" if u.query else "")
        self.topk, self.max_query_chars, self.max_queries = int(topk), int(max_query_chars), int(max_queries)
        self.max_body_bytes = int(max_body_bytes)
        self.cut_queries = 0  # queries shortened to max_query_chars so far

    def check(self) -> None:
        """The server's limits, then one query at start: a server that is down, on another path or speaking
        another API is found before the first step, not at the policy's first search, which an untrained
        model may never make."""
        self._learn_limits()
        self._request(["start-up check"])

    def _learn_limits(self) -> None:
        """`alignrl serve retrieve` names its limits in /health (a server started with a lower --max_queries
        refused a turn's queries mid-run before). Search-R1's own server has no /health: the defaults stay."""
        try:  # once, without retries: a server that is down is the check query's to name
            r = self.client.http.get("/health")
            health = r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return
        for key in ("max_queries", "max_query_chars", "max_body_bytes"):
            value = health.get(key) if isinstance(health, dict) else None
            if type(value) is int and value > 0:
                setattr(self, key, min(getattr(self, key), value))

    def search(self, queries: list[str]) -> list[str]:
        """One observation text per query (empty list in, empty list out)."""
        return [search_r1_layout(hits) for hits in self.search_contents(queries)]

    def search_contents(self, queries: list[str]) -> list[list[str]]:
        """Each query's passages (their `contents`: a title line, then the text), for callers that lay them out
        otherwise (verl's search tool)."""
        out: list[list[str]] = []
        for batch in self._batches(queries):
            out += self._request(batch)
        return out

    def _batches(self, queries: list[str]) -> Iterator[list[str]]:
        """Queries cut to max_query_chars (one the server would refuse would stop the run for what the policy
        wrote), in requests of at most max_queries queries and max_body_bytes bytes."""
        self.cut_queries += sum(len(q) > self.max_query_chars for q in queries)
        batch: list[str] = []
        size = room = self.max_body_bytes - len(self._body([])) - 64  # slack for the server's own count
        for q in (q[: self.max_query_chars] for q in queries):
            n = len(json.dumps(q, ensure_ascii=False).encode()) + 1
            if batch and (len(batch) == self.max_queries or n > size):
                yield batch
                batch, size = [], room
            batch.append(q)
            size -= n
        if batch:
            yield batch

    def _body(self, queries: list[str]) -> bytes:
        return json.dumps({"queries": queries, "topk": self.topk, "return_scores": True}, ensure_ascii=False).encode()

    def _request(self, queries: list[str]) -> list[list[str]]:
        body = self.client.request("POST", self.path, content=self._body(queries),
                                   headers={"Content-Type": "application/json"})
        result = body.get("result") if isinstance(body, dict) else None
        if not isinstance(result, list) or len(result) != len(queries):
            got = f"{len(result)} result lists" if isinstance(result, list) else "no 'result' list"
            raise ServiceError(f"retrieval service at {self.url} answered {len(queries)} queries with {got}; "
                               f"it does not speak Search-R1's /retrieve API (check {self.client.URL_KEY})")
        try:
            return [hit_contents(hits if isinstance(hits, list) else [None]) for hits in result]
        except ValueError as e:
            raise ServiceError(f"retrieval service at {self.url} sent a malformed result ({e}); it does not "
                               f"speak Search-R1's /retrieve API (check {self.client.URL_KEY})") from None

    def close(self) -> None:
        self.client.close()
