"""Plumbing shared by the services: flags, auth, request limits, error shape, serving (`process` starts them).

Every error a client can cause comes back as a 4xx JSON body in OpenAI's shape,
`{"error": {"message": "<one line>", "type": ..., "code": <status>}}`, so the `openai` client and our
own clients both surface the message. Auth is a single shared bearer token (`ALIGNRL_API_KEY`) on the
endpoints that change server state; serving beyond loopback without one is refused at startup,
because an open weight-update endpoint lets anyone on the network replace the model.

Deliberately left out: TLS (put a reverse proxy in front), per-user keys, rate limiting.
"""

from __future__ import annotations

import argparse
import hmac
import os
import signal
import socket
import sys

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from alignrl.runtime.ports import is_loopback
from alignrl.wire.http_service import API_KEY_ENV, HEALTHY, SERVICE_HEADER  # noqa: F401 (the services' names)

MB = 1 << 20


class RequestError(HTTPException):
    """A client mistake: `message` is one line saying what is wrong and how to fix it."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(status_code=status, detail=message)


def unicode_texts(texts: list[str], what: str) -> list[str]:
    """`texts` as given, once each is valid Unicode: JSON may carry a lone surrogate ("\\ud800"), which no
    tokenizer takes (a 500 from deep inside it otherwise)."""
    for i, s in enumerate(texts):
        if not s.isascii():
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(f"{what} {i} is not valid Unicode text (it holds a lone surrogate such as "
                                   "\\ud800); send UTF-8 text") from None
    return texts


def base_parser(prog: str, description: str, default_port: int) -> argparse.ArgumentParser:
    from alignrl.runtime.one_line import OneLineParser

    p = OneLineParser(prog=prog, description=description)
    p.add_argument("--model", required=True, help="Hugging Face model folder, or 'demo' for the embedded model")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    serving_flags(p, default_port)
    return p


def serving_flags(p: argparse.ArgumentParser, default_port: int) -> None:
    """The flags of every model server: where it listens and runs, and how requests join into batches."""
    p.add_argument("--host", default="127.0.0.1",
                   help=f"address to bind (default loopback only; any other host needs {API_KEY_ENV} set)")
    p.add_argument("--port", type=int, default=default_port)
    p.add_argument("--device", default="auto", help="where the model runs; auto: cuda when available, else cpu")
    p.add_argument("--max_body_mb", type=float, default=64.0, help="largest JSON request body accepted")
    p.add_argument("--max_batch", type=int, default=256, help="most sequences in one model call")
    p.add_argument("--max_request_seqs", type=int, default=1024, help="most sequences one request may ask for")
    p.add_argument("--batch_window_ms", type=float, default=5.0,
                   help="how long to wait for concurrent requests to join a batch")


def device_of(args: argparse.Namespace) -> str:
    """--device, with auto resolved: the first GPU when torch sees one, else the CPU."""
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device


def device_problem(name: str) -> str | None:
    import torch

    try:
        cuda = torch.device(name).type == "cuda"
    except (RuntimeError, ValueError):
        return f"--device {name!r} is not a torch device; pass auto, cpu, cuda or cuda:N"
    return (f"--device {name} but torch sees no CUDA GPU here; pass --device cpu (or auto)"
            if cuda and not torch.cuda.is_available() else None)


def host_error(host: str) -> str | None:
    """Why the service must not start on `host`, or None."""
    if os.environ.get(API_KEY_ENV) or is_loopback(host):
        return None
    return (f"refusing to serve on non-loopback host {host!r} without authentication: "
            f"set {API_KEY_ENV}=<secret> (clients send it as a bearer token) or use --host 127.0.0.1")


def check_args(args: argparse.Namespace) -> str | None:
    """The first problem with the common flags, as a one-line message, or None."""
    if not 0 <= args.port <= 65535:
        return f"--port {args.port} is not a TCP port; pass 0..65535"
    for name in ("max_batch", "max_request_seqs", "micro_batch"):  # micro_batch: the ref and reward servers
        if getattr(args, name, 1) < 1:
            return f"--{name} must be at least 1"
    if args.max_body_mb <= 0 or args.batch_window_ms < 0:
        return "--max_body_mb must be positive and --batch_window_ms not negative"
    return (args.device != "auto" and device_problem(args.device)) or host_error(args.host)


def fail(prog: str, message: str) -> int:
    """One line, exit 2; in the name and flags of a seed script that started the service (launch_vllm.py)."""
    from alignrl.errors import PROGRAM_ENV, in_flag_words

    print(f"{os.environ.get(PROGRAM_ENV) or prog}: error: {in_flag_words(message)}", file=sys.stderr)
    return 2


def _error_body(status: int, message: str) -> JSONResponse:
    kind = "authentication_error" if status == 401 else "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}},
                        status_code=status)


def _validation_message(exc: RequestValidationError) -> str:
    errors = exc.errors()
    if not errors:
        return "invalid request body"
    e = errors[0]
    loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
    if e.get("type") == "json_invalid":
        return "request body is not valid JSON; send a JSON object with Content-Type: application/json"
    field = [x for x in e.get("loc", ()) if x != "body"][:1]
    if field and len(errors) > 1 and all([x for x in o.get("loc", ()) if x != "body"][:1] == field for o in errors):
        # A union field (e.g. `prompt`: text or token ids) reports one error per accepted form.
        return (f"{field[0]}: the value matches none of the accepted forms ({e.get('msg')} ...); "
                "send one of the documented forms")
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return f"{loc}: {e.get('msg', 'invalid value')}{more}; fix that field and resend"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_body(400, _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_body(exc.status_code, str(exc.detail).replace("\n", " "))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        # Inputs are validated before they reach a model, so this is a server fault, not a client's.
        first = (str(exc).splitlines() or [""])[0]
        return _error_body(500, f"internal error: {type(exc).__name__}: {first}")


class BodyLimit:
    """ASGI middleware: refuse bodies over the path's limit with 413 before the app parses them.

    The body is read here (and replayed to the app) so a chunked request without Content-Length is
    bounded too. An over-long body is drained rather than cut off, so the client reads the 413
    instead of a reset connection. On `token_paths` (the weight update, whose limit is the whole model's
    size) a request without the server's bearer token is refused with 401 before any of its body is read:
    anyone who can reach the port could otherwise make the server hold tens of GB."""

    def __init__(self, app, default_bytes: int, per_path: dict[str, int] | None = None,
                 token_paths: frozenset[str] = frozenset()):
        self.app, self.default, self.per_path, self.token_paths = app, default_bytes, per_path or {}, token_paths
        self.key = os.environ.get(API_KEY_ENV) or None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] in self.token_paths and self.key:
            sent = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            problem = token_problem(sent, self.key)
            if problem:
                return await _error_body(401, problem)(scope, receive, send)
        limit = self.per_path.get(scope["path"], self.default)
        chunks, total, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            part = msg.get("body", b"")
            total += len(part)
            if total <= limit:
                chunks.append(part)
            else:
                chunks.clear()
            more = msg.get("more_body", False)
        if total > limit:
            resp = _error_body(413, f"request body of {total} bytes exceeds this endpoint's limit of {limit} "
                                    "bytes; send fewer or shorter prompts per request, or start the server with a "
                                    "larger --max_body_mb")
            return await resp(scope, receive, send)
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)  # one chunk: no copy
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def token_problem(authorization: str, key: str) -> str | None:
    """Why an Authorization header does not carry the bearer token `key` (None: it does)."""
    if hmac.compare_digest(authorization.encode(), f"Bearer {key}".encode()):
        return None
    return (f"missing or wrong bearer token: send the header 'Authorization: Bearer ${API_KEY_ENV}' (the key the "
            "server was started with)")


def new_app(title: str, service: str, max_body: int, per_path_body: dict[str, int] | None = None,
            token_paths: frozenset[str] = frozenset()) -> FastAPI:
    app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, default_bytes=max_body, per_path=per_path_body or {}, token_paths=token_paths)

    @app.get("/health")
    async def health(response: Response) -> dict:
        response.headers[SERVICE_HEADER] = service
        return HEALTHY

    return app


class PortError(ValueError):
    """The service's address cannot be bound; the message names it and what to do."""


def bind(host: str, port: int) -> socket.socket:
    """The service's socket, bound before the (slow) model load so a taken port fails at once, in one
    line; it starts listening when the app is ready (`serve`)."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        # as uvicorn does: a restart may take a port whose old connections linger in TIME_WAIT; a port
        # some process listens on still refuses the bind
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise PortError(f"cannot bind {host}:{port} ({e.strerror or e}); pick another --port or stop the "
                        "process using it") from None
    return sock


def address(sock: socket.socket) -> str:
    """http://host:port of a bound socket (the real port when --port 0 asked for any free one)."""
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def serve(app: FastAPI, sock: socket.socket, ready: str, *, stdout: bool = False) -> int:
    """Serves `app` on the bound `sock` and prints `ready` once it accepts connections (not before:
    a client told to connect must be able to)."""
    import uvicorn

    from alignrl.runtime.heap import settled

    settled()  # start-up is over: what it built is frozen (runtime.heap)

    class Server(uvicorn.Server):
        interrupted = False

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                print(ready, file=sys.stdout if stdout else sys.stderr, flush=True)

        def handle_exit(self, sig, frame) -> None:
            self.interrupted = self.interrupted or sig == signal.SIGINT
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=30))
    try:
        server.run(sockets=[sock])
    except OSError as e:  # listen() lost a race for the port to another process binding it meanwhile
        raise PortError(f"cannot listen on {address(sock)} ({e.strerror or e}); pick another --port") from None
    finally:
        sock.close()
    if server.interrupted:  # after the graceful stop uvicorn re-raises Ctrl-C, which asyncio's runner may swallow
        raise KeyboardInterrupt
    return 0


def listening(name: str, host: str, sock: socket.socket) -> str:
    scope = "loopback only" if is_loopback(host) else f"bearer token from ${API_KEY_ENV} on updates"
    return f"alignrl serve {name}: listening on {address(sock)} ({scope})"


def start(name: str, args: argparse.Namespace, load, build) -> int:
    """A model service's main after its flags were checked: bind, load the model (`load(args)`), build
    the app (`build(service, max_body_bytes)`), serve. Every user error is one line and exit 2."""
    try:
        sock = bind(args.host, args.port)
    except PortError as e:
        return fail(f"alignrl serve {name}", str(e))
    try:
        service = load(args)
    except ValueError as e:  # ModelError, missing vllm: one line, no traceback
        sock.close()
        return fail(f"alignrl serve {name}", str(e))
    try:
        return serve(build(service, int(args.max_body_mb * MB)), sock, listening(name, args.host, sock))
    except PortError as e:
        return fail(f"alignrl serve {name}", str(e))
