"""Generation server: OpenAI-compatible completions plus a token-level endpoint and weight sync.

    alignrl serve generate --model PATH --port 8000 [--engine hf|vllm] [--tensor_parallel_size N]
                           [--host H] [--max_batch N] [--default_chat_template_kwargs JSON]
                           [--min_pixels N] [--max_pixels N]

Endpoints: `GET /health` (exactly {"status": "healthy"}), `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions`, `POST /v1/generate_tokens` (token ids in, token ids + per-token
log-probs + finish reasons + the weight version out: what an RL trainer needs), `POST
/v1/update_weights` (bearer token when ALIGNRL_API_KEY is set; body in the `serve.weights` format),
`GET /v1/weight_version`, `GET /v1/weights_manifest` (names, shapes, dtypes to push) and
`GET /v1/stats` (requests vs engine calls, to see batching at work; `running`: requests in the engine now).

`/v1/generate_tokens` returns the tokens exactly as sampled: a stop string's tokens stay in, as they
do in the in-process engine's rollouts; the OpenAI endpoints cut the text before the stop string.
Log-probs are the in-process engine's: of the sampled token under the temperature-scaled distribution.
Requests with a `seed` are never merged with other requests, so a seeded request gives the same
output however busy the server is. `--default_chat_template_kwargs` (vLLM's `--default-chat-template-kwargs`, e.g.
'{"enable_thinking": false}') are variables of the chat template for every chat request; a request's own
`chat_template_kwargs` win over them, name by name. A vision-language prompt's images come in `images`, as PNG
pictures with their grids or as float32 pixel rows (`serve.request_images`); the server processes pictures itself,
resizing them within `--min_pixels`/`--max_pixels` (give the trainer's data.min_pixels/max_pixels), and vLLM takes
pictures only. Deliberately left out: streaming, best_of, echo, tools.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from math import prod

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from alignrl.serve import openai_format as oa
from alignrl.serve.common import (RequestError, base_parser, check_args, device_of, fail, new_app,
                                  start, unicode_texts)
from alignrl.serve.gen_types import MAX_N, MAX_STOP_LEN, MAX_STOPS, GenResult, GenRow, sampling
from alignrl.serve.request_images import image_prompts

PROG = "alignrl serve generate"


class TokensRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    prompts: list[list[StrictInt]] = Field(min_length=1)
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    max_tokens: int = Field(64, ge=1)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOPS)
    seed: int | None = Field(None, ge=0, lt=2**63)
    # per prompt, its images (None: a text prompt), as pictures or pixel rows (`serve.request_images`); for a
    # vision-language model, whose prompt ids already hold the image tokens
    images: list[dict | None] | None = None


@dataclass(frozen=True)
class GenJob:
    prompts: list[list[int]]
    top_logprobs: int = 0  # alternatives per position wanted by an OpenAI request; 0: sampled token only


@dataclass
class Limits:
    vocab_size: int
    max_model_len: int
    max_request_seqs: int


@dataclass
class GenerationService:
    """The engine behind one batcher; every model call and weight swap runs on its worker thread."""

    engine: object  # HFRolloutEngine or VLLMRolloutEngine: generate(prompts, SamplingParams), load_weights
    tokenizer: object
    model_name: str
    limits: Limits
    manifest: dict  # name -> serve.weights.TensorSpec
    max_batch: int = 256
    window_s: float = 0.005
    version: int = 0
    engine_calls: int = 0
    weight_updates: int = 0
    _unique: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        from alignrl.serve.batcher import Batcher

        self.batcher = Batcher(self._run, self.window_s, self.max_batch)

    def check(self, prompts: Sequence[Sequence[int]], n: int, max_tokens: int, stop: Sequence[str]) -> None:
        """Reject what the model cannot run, naming the first offending prompt."""
        lim = self.limits
        if not prompts:
            raise RequestError("no prompts given; send at least one")
        if len(prompts) * n > lim.max_request_seqs:
            raise RequestError(f"{len(prompts)} prompts x n={n} = {len(prompts) * n} sequences exceeds this "
                               f"server's limit of {lim.max_request_seqs} per request; split the request")
        for i, p in enumerate(prompts):
            if not p:
                raise RequestError(f"prompt {i} is empty; every prompt needs at least one token")
            bad = next((t for t in p if not 0 <= t < lim.vocab_size), None)
            if bad is not None:
                raise RequestError(f"prompt {i} has token id {bad}, outside this model's vocabulary "
                                   f"[0, {lim.vocab_size}); tokenize with the served model's tokenizer")
            if len(p) + max_tokens > lim.max_model_len:
                raise RequestError(f"prompt {i} has {len(p)} tokens + max_tokens {max_tokens} > the model's "
                                   f"context of {lim.max_model_len}; shorten the prompt or lower max_tokens")
        for s in stop:
            if not s or len(s) > MAX_STOP_LEN:
                raise RequestError(f"stop strings must be 1..{MAX_STOP_LEN} characters; got {s!r}")
        unicode_texts(list(stop), "stop string")  # the engine encodes them: a lone surrogate was a 500

    async def generate(self, prompts: list[list[int]], params, top_logprobs: int = 0) -> GenResult:
        self.check(prompts, params.n, params.max_new_tokens, params.stop)
        # Seeded requests get a key of their own: merged, their samples would depend on the company.
        key: Hashable = (params, None if params.seed is None else next(self._unique))
        return await self.batcher.submit(key, GenJob(prompts, top_logprobs), len(prompts) * params.n)

    def _run(self, key: tuple, jobs: list[GenJob]) -> list[GenResult]:
        params = key[0]
        prompts = [p for j in jobs for p in j.prompts]
        per_call = max(1, self.max_batch // params.n)  # whole prompts per call, so groups stay together
        rows: list[GenRow] = []
        for k, s in enumerate(range(0, len(prompts), per_call)):
            ro = self.engine.generate(prompts[s:s + per_call], chunk_seed(params, k, 7919))
            self.engine_calls += 1
            for i in range(ro.response_ids.shape[0]):
                m = ro.response_mask[i]
                rows.append(GenRow(ro.response_ids[i][m].tolist(), ro.logprobs[i][m].tolist(),
                                   "length" if bool(ro.truncated[i]) else "stop"))
        out, start = [], 0
        for j in jobs:
            mine = rows[start:start + len(j.prompts) * params.n]
            start += len(mine)
            if j.top_logprobs and hasattr(self.engine, "model"):
                expanded = [p for p in j.prompts for _ in range(params.n)]
                tops = top_logprobs(self.engine.model, expanded, [r.token_ids for r in mine], j.top_logprobs,
                                    params.temperature, self.engine.pad_id)
                for r, t in zip(mine, tops):
                    r.top = t
            out.append(GenResult(mine, self.version))
        return out

    async def update_weights(self, body: bytes) -> dict:
        import asyncio

        from alignrl.wire.http_weights import WireError, check_against, decode

        t0 = time.perf_counter()

        def parse():
            upd = decode(body)
            check_against(upd, self.manifest)
            return upd

        try:  # decode and validate everything before the swap: a bad body leaves the old weights
            upd = await asyncio.to_thread(parse)
        except WireError as e:
            raise RequestError(f"weight update rejected: {e}") from None

        def swap():
            if upd.version <= self.version:
                raise RequestError(f"weight version {upd.version} is not newer than the served version "
                                   f"{self.version}; send a larger version", status=409)
            self.engine.load_weights(upd.tensors.items())
            self.version = upd.version
            self.weight_updates += 1

        await self.batcher.call(swap)
        return {"weight_version": self.version, "tensors": len(upd.tensors), "bytes": upd.nbytes,
                "seconds": round(time.perf_counter() - t0, 4)}


def chunk_seed(params, k: int, stride: int):
    """Params for the k-th slice of a seeded request: each slice gets its own seed, or all slices would
    draw the same random numbers row for row."""
    if k == 0 or params.seed is None:
        return params
    return replace(params, seed=(params.seed + k * stride) % 2**63)


def top_logprobs(model, prompts: list[list[int]], responses: list[list[int]], k: int, temperature: float,
                 pad_id: int, budget_bytes: int = 256 << 20) -> list[list[list[tuple[int, float]]]]:
    """The k most likely tokens at each response position, one extra forward pass (OpenAI `logprobs`), over as
    many rows at a time as keep their fp32 logits and log_softmax's copy within `budget_bytes`: a whole request
    (n x max_tokens x the vocabulary) at once would be tens of GB for a 150k vocabulary."""
    from alignrl.rollout.hf_engine import GREEDY_BELOW

    width, vocab = 1 + max(map(len, responses)), model.config.get_text_config().vocab_size
    rows = max(1, budget_bytes // (3 * 4 * width * vocab))
    temperature = temperature if temperature >= GREEDY_BELOW else 0.0
    return [top for s in range(0, len(responses), rows)
            for top in _top_logprobs(model, prompts[s:s + rows], responses[s:s + rows], k, temperature, pad_id)]


def _top_logprobs(model, prompts: list[list[int]], responses: list[list[int]], k: int, temperature: float,
                  pad_id: int) -> list[list[list[tuple[int, float]]]]:
    import torch

    from alignrl.data.collate import left_pad, position_ids, right_pad

    from alignrl.data.images import prompt_images
    from alignrl.models.vision import vision_inputs

    pids, pm = left_pad(prompts, pad_id)
    rids, rm = right_pad(responses, pad_id)
    ids, mask = torch.cat([pids, rids], 1), torch.cat([pm, rm], 1)
    vision = vision_inputs(model, ids, mask, prompt_images(prompts))  # {} for text prompts
    vision.setdefault("position_ids", position_ids(mask))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask.long(), **vision,
                       use_cache=False, logits_to_keep=rids.shape[1] + 1).logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    vals, idx = torch.log_softmax(logits, -1).topk(min(k, logits.shape[-1]), -1)
    return [[list(zip(idx[b, t].tolist(), vals[b, t].tolist())) for t in range(len(r))]
            for b, r in enumerate(responses)]


def build_app(svc: GenerationService, max_body: int):
    # Room for every parameter at 8 bytes (float64 at most) plus header: a wrong dtype then gets its
    # own clear message from the validator instead of a bare 413.
    weights_body = sum(8 * prod(s.shape) + 256 for s in svc.manifest.values()) + (16 << 20)
    app = new_app("alignrl generation", "generation", max_body, {"/v1/update_weights": weights_body},
                  token_paths=frozenset({"/v1/update_weights"}))

    oa.add_routes(app, svc)

    @app.post("/v1/generate_tokens")
    async def generate_tokens(req: TokensRequest) -> dict:
        params = sampling(req.n, req.temperature, req.top_p, req.top_k, req.max_tokens, req.stop, req.seed,
                          req.min_p, req.repetition_penalty)
        if req.images is None:  # a vision-language model's image tokens without images are still refused
            prompts = image_prompts(req, svc.tokenizer, svc.engine)
        else:  # decoding and resizing pictures takes a while: off the event loop, which keeps answering /health
            import asyncio

            prompts = await asyncio.to_thread(image_prompts, req, svc.tokenizer, svc.engine)
        res = await svc.generate(prompts, params)
        return {"weight_version": res.version,
                "outputs": [{"prompt_index": i // req.n, "token_ids": r.token_ids, "logprobs": r.logprobs,
                             "finish_reason": r.finish_reason} for i, r in enumerate(res.rows)]}

    @app.post("/v1/update_weights")  # the bearer token is checked before the body is read (BodyLimit)
    async def update_weights(request: Request) -> dict:
        return await svc.update_weights(await request.body())

    @app.get("/v1/weight_version")
    async def weight_version() -> dict:
        return {"weight_version": svc.version}

    @app.get("/v1/weights_manifest")
    async def weights_manifest() -> dict:
        return {"weight_version": svc.version, "tensors": {n: s.as_dict() for n, s in svc.manifest.items()}}

    @app.get("/v1/stats")
    async def stats() -> dict:
        return {**svc.batcher.stats.as_dict(), "engine_calls": svc.engine_calls, "weight_version": svc.version,
                "weight_updates": svc.weight_updates}

    return app


def parser() -> argparse.ArgumentParser:
    p = base_parser(PROG, "OpenAI-compatible generation server with weight sync", 8000)
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    p.add_argument("--tensor_parallel_size", type=int, default=1, help="GPUs per model (vllm engine)")
    p.add_argument("--max_model_len", type=int, default=0, help="context length (default: the model's)")
    p.add_argument("--served_model_name", default="", help="name in /v1/models (default: the --model value)")
    p.add_argument("--default_chat_template_kwargs", "--default-chat-template-kwargs", default="", metavar="JSON",
                   help="variables of the chat template for every chat request, as a JSON object, e.g. "
                        "'{\"enable_thinking\": false}'; a request's chat_template_kwargs win, name by name")
    for bound, side in (("min", "smaller"), ("max", "larger")):  # as data.min_pixels/max_pixels in a run
        p.add_argument(f"--{bound}_pixels", type=int, default=0, metavar="N",
                       help=f"a vision-language model's images {side} than N pixels are resized to N (0: the "
                            f"processor's own bound); give the trainer's data.{bound}_pixels, whose processor made "
                            "the request's image grids")
    return p


def default_template_variables(text: str) -> dict:
    """--default_chat_template_kwargs as a mapping ({} when not given); ValueError in one line otherwise."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--default_chat_template_kwargs is not JSON ({e}); give an object, e.g. "
                         "'{\"enable_thinking\": false}'") from None
    return oa.template_variables(value, "--default_chat_template_kwargs")


def load_service(args: argparse.Namespace) -> GenerationService:
    from alignrl.models.loader import resolve_model_path
    from alignrl.wire.http_weights import manifest_of

    folder = resolve_model_path(args.model, log=lambda *a: print(*a, file=sys.stderr), key="--model")
    # before any engine sees it: past the trained positions a model's output is garbage (vLLM refuses it too)
    config = json.loads((folder / "config.json").read_text())
    longest = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    if longest and args.max_model_len > longest:
        raise ValueError(f"--max_model_len {args.max_model_len} is longer than the model's context of {longest} "
                         f"(max_position_embeddings in {folder / 'config.json'}); give at most {longest} or leave "
                         "it out")
    if args.engine == "vllm":
        from alignrl.rollout.vllm_engine import VLLMRolloutEngine

        engine = VLLMRolloutEngine(str(folder), args.tensor_parallel_size, args.dtype, args.max_model_len or None,
                                   min_pixels=args.min_pixels, max_pixels=args.max_pixels)
        # a vision-language model's vocabulary and context are its language model's (none at the top of its config)
        tok, cfg, manifest = engine.tokenizer, engine.config.get_text_config(), engine.manifest()
    else:
        from alignrl.models.loader import load_model
        from alignrl.rollout.hf_engine import HFRolloutEngine

        model, tok = load_model(str(folder), args.dtype, log=lambda *a: print(*a, file=sys.stderr), chat=False,
                                key="--model", min_pixels=args.min_pixels, max_pixels=args.max_pixels)
        model = model.to(device_of(args)).eval()  # on a GPU machine without vLLM (launch_vllm.py): its GPU
        engine, cfg = HFRolloutEngine(model, tok), model.config.get_text_config()  # a VLM's: its language model's
        manifest = manifest_of(model.named_parameters())
    from alignrl.models.loader import with_template_variables

    # every chat request renders with them unless it sets a variable itself (its own apply_chat_template keywords)
    with_template_variables(tok, default_template_variables(args.default_chat_template_kwargs))
    vocab = getattr(getattr(engine, "model", None), "get_input_embeddings", lambda: None)()
    limits = Limits(vocab_size=vocab.num_embeddings if vocab is not None else cfg.vocab_size,
                    max_model_len=args.max_model_len or getattr(cfg, "max_position_embeddings", 4096),
                    max_request_seqs=args.max_request_seqs)
    return GenerationService(engine, tok, args.served_model_name or args.model, limits, manifest,
                             args.max_batch, args.batch_window_ms / 1000)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    problem = check_args(args)
    if problem is None and args.tensor_parallel_size < 1:
        problem = "--tensor_parallel_size must be at least 1"
    if problem is None and min(args.min_pixels, args.max_pixels) < 0:
        problem = "--min_pixels and --max_pixels are pixel counts: give a positive number, or 0 for the processor's own"
    if problem is None and 0 < args.max_pixels < args.min_pixels:
        problem = f"--min_pixels {args.min_pixels} is above --max_pixels {args.max_pixels}: give min <= max"
    if problem is None and args.max_model_len < 0:
        problem = f"--max_model_len {args.max_model_len} must be a positive context length (0: the model's)"
    if problem is None:
        try:  # before the model loads: a typo in the JSON is said at once
            default_template_variables(args.default_chat_template_kwargs)
        except ValueError as e:
            problem = str(e)
    if problem:
        return fail(PROG, problem)
    if args.engine == "hf" and args.tensor_parallel_size > 1:  # the seed's launcher passes 8: say what it does here
        print(f"{PROG}: --tensor_parallel_size {args.tensor_parallel_size} not used: the embedded HF engine runs the "
              "model on one device (vLLM splits it; run more servers to spread the load)", file=sys.stderr)
    return start("generate", args, load_service, build_app)
