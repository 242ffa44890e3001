"""The search tool of multi-turn rollouts: a client of Search-R1's retrieval API (`alignrl serve retrieve`,
or Search-R1's own `retrieval_server.py`).

    POST <url> {"queries": [...], "topk": k, "return_scores": true}
      -> {"result": [[{"document": {"contents": "\\"Title\\"\\ntext"}, "score": s}, ...], ...]}

Each query's passages become one observation text laid out as Search-R1 shows them to the model,
`Doc 1(Title: ...) text\\nDoc 2(Title: ...) text\\n`. All the queries of one turn go in one request
(split only past the server's per-request limit). Connection errors, timeouts and 5xx answers are
retried with backoff; every failure is one `ServiceError` line naming the URL. Deliberately left out:
reranking and caching of repeated queries.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlparse

from alignrl.config.checks import retriever_url_problem
from alignrl.rollout.remote import ServiceClient, ServiceError

MAX_QUERY_CHARS = 8192  # `alignrl serve retrieve` refuses longer queries; a model can write anything
MAX_QUERIES = 512  # queries per request the server accepts by default


class _RetrievalService(ServiceClient):
    """The shared HTTP client, with the start hint of the retrieval server."""

    def _hint(self) -> str:
        port = urlparse(self.url).port or 80
        return f"alignrl serve retrieve --port {port}"


def passages_text(hits: Sequence) -> str:
    """Search-R1's layout of one query's hits: `Doc i(Title: <first line>) <rest>` per line.
    A hit is `{"document": {"contents": ...}, "score": s}` or, without scores, `{"contents": ...}`."""
    lines = []
    for i, hit in enumerate(hits, start=1):
        doc = hit.get("document", hit) if isinstance(hit, dict) else None
        contents = doc.get("contents") if isinstance(doc, dict) else None
        if not isinstance(contents, str):
            raise ValueError(f"hit {i} has no 'contents' string")
        title, _, text = contents.partition("\n")
        lines.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(lines)


class RetrieverClient:
    """`search(queries) -> one observation text per query` against a retrieval server."""

    def __init__(self, url: str, topk: int = 3, timeout_s: float = 30.0, retries: int = 3,
                 max_query_chars: int = MAX_QUERY_CHARS, max_queries: int = MAX_QUERIES):
        problem = retriever_url_problem(url)
        if problem:
            raise ServiceError(problem)
        path = urlparse(url).path
        base = url[: len(url) - len(path)] if path else url
        self.client = _RetrievalService(base, "retrieval", timeout=timeout_s, retries=retries)
        self.url, self.path = url, path or "/retrieve"
        self.topk, self.max_query_chars, self.max_queries = int(topk), int(max_query_chars), int(max_queries)
        self.cut_queries = 0  # queries shortened to max_query_chars so far

    def check(self) -> None:
        """One query at start: a server that is down, on another path or speaking another API is found before
        the first step, not at the policy's first search, which an untrained model may never make."""
        self._request(["start-up check"])

    def search(self, queries: list[str]) -> list[str]:
        """One observation text per query (empty list in, empty list out)."""
        out: list[str] = []
        for s in range(0, len(queries), self.max_queries):
            out += self._request(list(queries[s:s + self.max_queries]))
        return out

    def _request(self, queries: list[str]) -> list[str]:
        # A query the server would refuse (413) would stop the run for what the policy wrote: cut it.
        long = [q for q in queries if len(q) > self.max_query_chars]
        self.cut_queries += len(long)
        queries = [q[: self.max_query_chars] for q in queries]
        body = self.client.request("POST", self.path, json={"queries": queries, "topk": self.topk,
                                                             "return_scores": True})
        result = body.get("result") if isinstance(body, dict) else None
        if not isinstance(result, list) or len(result) != len(queries):
            got = f"{len(result)} result lists" if isinstance(result, list) else "no 'result' list"
            raise ServiceError(f"retrieval service at {self.url} answered {len(queries)} queries with {got}; "
                               "it does not speak Search-R1's /retrieve API (check retriever.url)")
        try:
            return [passages_text(hits if isinstance(hits, list) else [None]) for hits in result]
        except ValueError as e:
            raise ServiceError(f"retrieval service at {self.url} sent a malformed result ({e}); it does not "
                               "speak Search-R1's /retrieve API (check retriever.url)") from None

    def close(self) -> None:
        self.client.close()
