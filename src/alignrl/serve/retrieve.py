"""`alignrl serve retrieve`: Search-R1's retrieval API over a jsonl corpus (BM25 or dense).

    POST /retrieve {"queries": [...], "topk": 3, "return_scores": true}
      -> {"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}   (return_scores true)
      -> {"result": [[{"id", "contents"}, ...], ...]}                              (return_scores false)
    bad request -> 4xx {"error": {"message": "<one line>", "type": "invalid_request_error", "code": status}}
    GET /health -> {"status": "healthy", "max_queries", "max_query_chars", "max_body_bytes", "max_topk"}

Requests are parsed by hand rather than by a pydantic model so that every bad request gets one
plain line (and a 4xx), bodies are capped before they are read whole, and no type is coerced
silently ("3" is not a topk). Deliberately left out: authentication (hence loopback by default),
reranking, and the reference server's per-query `return_scores` quirks.
"""

from __future__ import annotations

import argparse
import json
import os
import asyncio
import sys
from dataclasses import asdict, dataclass

# Module level, not inside create_app: FastAPI resolves the (string) annotation `Request` by name.
from fastapi import Request, Response

from alignrl.retrieval.corpus import SHIPPED_CORPUS, Hit, RetrievalError, Retriever
from alignrl.retrieval.index import DENSE, canonical_name, default_index_root, open_retriever
from alignrl.runtime.ports import is_loopback
from alignrl.serve.common import SERVICE_HEADER, PortError, address, bind, fail, serve

PROG = "alignrl serve retrieve"


@dataclass(frozen=True)
class Limits:
    max_queries: int = 512          # per request; one encoder call handles them all
    max_topk: int = 100
    max_query_chars: int = 8192
    max_body_bytes: int = 4 << 20


class RequestError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class RetrieveRequest:
    queries: list[str]
    topk: int
    return_scores: bool


def parse_request(body: bytes, default_topk: int, limits: Limits) -> RetrieveRequest:
    """Validate a /retrieve body; raises RequestError with a one-line message."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: absurdly nested arrays
        raise RequestError(400, 'body is not valid JSON; send {"queries": ["..."], "topk": 3, '
                                '"return_scores": true}') from None
    if not isinstance(obj, dict):
        raise RequestError(422, f"body must be a JSON object with 'queries', got {type(obj).__name__}")
    queries = obj.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise RequestError(422, "'queries' must be a list of strings")
    if len(queries) > limits.max_queries:
        raise RequestError(413, f"{len(queries)} queries in one request; at most {limits.max_queries}, "
                                "split the batch")
    longest = max((len(q) for q in queries), default=0)
    if longest > limits.max_query_chars:
        raise RequestError(413, f"a query has {longest} characters; at most {limits.max_query_chars}")
    # JSON may carry lone surrogates ("\ud800") that no tokenizer accepts; replace them with "?".
    queries = [q.encode("utf-8", "replace").decode("utf-8") for q in queries]
    topk = obj.get("topk")
    if topk is None or (topk == 0 and type(topk) is int):  # Search-R1's server: a topk of 0 means its default
        topk = default_topk
    # bool is an int subclass in Python; `"topk": true` is a client bug, not 1.
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise RequestError(422, f"'topk' must be an integer, got {type(topk).__name__}")
    if not 1 <= topk <= limits.max_topk:
        raise RequestError(422, f"'topk' must be between 1 and {limits.max_topk}, got {topk}")
    return_scores = obj.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise RequestError(422, f"'return_scores' must be true or false, got {type(return_scores).__name__}")
    return RetrieveRequest(queries, topk, return_scores)


def render(hits: list[list[Hit]], return_scores: bool) -> dict:
    def doc(h: Hit) -> dict:
        return {"id": h.doc_id, "contents": h.contents}

    if return_scores:
        return {"result": [[{"document": doc(h), "score": h.score} for h in row] for row in hits]}
    return {"result": [[doc(h) for h in row] for row in hits]}


def create_app(retriever: Retriever, default_topk: int = 3, limits: Limits = Limits()):
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException

    app = FastAPI(title="alignrl retrieval", docs_url=None, redoc_url=None, openapi_url=None)
    # One search at a time: a request's queries are already batched, and parallel encoder calls on a
    # CPU node would only fight over the same cores.
    turn = asyncio.Lock()

    def error(status: int, message: str) -> JSONResponse:
        # The same OpenAI-style error body as the other alignrl services, so one client parses all.
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                       "code": status}}, status_code=status)

    @app.exception_handler(HTTPException)
    async def _http_error(request, exc: HTTPException):
        return error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}; "
                                      "use POST /retrieve or GET /health")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc):
        return error(422, "invalid request")

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise RequestError(400, "Content-Length header is not a number")
            if int(declared) > limits.max_body_bytes:
                raise RequestError(413, f"body of {declared} bytes; at most {limits.max_body_bytes}")
        chunks, size = [], 0
        async for chunk in request.stream():  # also caps chunked bodies that declare no length
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise RequestError(413, f"body over {limits.max_body_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def search(req: RetrieveRequest) -> dict:
        # a turn in which no row searched: Search-R1's trainer asks all the same, and reads {"result": []}
        return render(retriever.search(req.queries, req.topk) if req.queries else [], req.return_scores)

    @app.post("/retrieve")
    async def retrieve(request: Request):
        try:
            req = parse_request(await read_body(request), default_topk, limits)
        except RequestError as e:
            return error(e.status, e.message)
        async with turn:
            # a client that gave up while this request waited its turn reads no answer: searching for it
            # would only delay the requests queued behind
            if await request.is_disconnected():
                return error(499, "the client closed the connection before its turn")
            return JSONResponse(await run_in_threadpool(search, req))

    @app.get("/health")
    async def health(response: Response):
        response.headers[SERVICE_HEADER] = "retrieval"
        return {"status": "healthy", **asdict(limits)}

    return app


def _parser() -> argparse.ArgumentParser:
    from alignrl.runtime.one_line import OneLineParser

    p = OneLineParser(prog=PROG, description="Search-R1 retrieval API (POST /retrieve, GET /health).")
    p.add_argument("--corpus_path", default=str(SHIPPED_CORPUS),
                   help="jsonl with one {\"id\", \"contents\"} per line (default: the shipped wiki_small corpus)")
    p.add_argument("--index_path", default=None,
                   help="folder for built indexes, keyed by corpus and settings (default: "
                        f"{default_index_root()}), or a FAISS index file built elsewhere (e.g. Search-R1's "
                        "e5_Flat.index, row i = corpus line i), loaded read-only")
    p.add_argument("--retriever_name", default="minilm", help="bm25, minilm (alias: dense) or e5")
    p.add_argument("--retriever_model", default=None,
                   help="dense encoder folder (default: the packaged MiniLM; e5 needs a local e5-base-v2)")
    p.add_argument("--topk", type=int, default=3, help="results per query when a request gives no topk")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed when ready)")
    p.add_argument("--allow-remote", "--allow_remote", dest="allow_remote", action="store_true",
                   help="allow a non-loopback --host; the API has no authentication")
    p.add_argument("--faiss_gpu", action="store_true", help="search the dense index on all visible GPUs")
    p.add_argument("--max_queries", type=int, default=Limits.max_queries)
    p.add_argument("--max_topk", type=int, default=Limits.max_topk)
    return p


def _check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> str:
    try:
        name = canonical_name(a.retriever_name)
    except RetrievalError as e:
        p.error(str(e))
    if not 1 <= a.topk <= a.max_topk:
        p.error(f"--topk must be between 1 and --max_topk ({a.max_topk}), got {a.topk}")
    if a.max_queries < 1:
        p.error(f"--max_queries must be at least 1, got {a.max_queries}")
    if not 0 <= a.port <= 65535:
        p.error(f"--port must be between 0 and 65535, got {a.port}")
    if not is_loopback(a.host) and not a.allow_remote:
        p.error(f"--host {a.host} is not a loopback address and the API has no authentication; "
                "pass --allow-remote to serve on the network")
    if a.faiss_gpu and name not in DENSE:
        p.error("--faiss_gpu applies to dense retrievers (minilm, e5), not bm25")
    if a.faiss_gpu:
        import faiss

        if not hasattr(faiss, "get_num_gpus") or faiss.get_num_gpus() == 0:
            p.error("--faiss_gpu given but FAISS sees no GPU (faiss-cpu installed or no CUDA device); drop it")
    return name


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    name = _check_args(parser, args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    def log(msg: str) -> None:
        print(f"{PROG}: {msg}", file=sys.stderr, flush=True)

    sock = None
    try:
        sock = bind(args.host, args.port)
        opened = open_retriever(args.corpus_path, name, args.index_path, args.retriever_model,
                                args.faiss_gpu, log=log)
    except (PortError, RetrievalError) as e:
        if sock is not None:
            sock.close()
        return fail(PROG, str(e))
    limits = Limits(max_queries=args.max_queries, max_topk=args.max_topk)
    ready = (f"{PROG}: {name} over {opened.num_docs} documents, index {'built' if opened.built else 'loaded'} in "
             f"{opened.seconds:.1f}s ({opened.folder}); ready on {address(sock)}/retrieve")
    try:
        return serve(create_app(opened.retriever, args.topk, limits), sock, ready, stdout=True)
    except PortError as e:
        return fail(PROG, str(e))


if __name__ == "__main__":
    sys.exit(main())
