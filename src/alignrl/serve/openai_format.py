"""OpenAI request models and response bodies for `/v1/completions` and `/v1/chat/completions`.

Fields that change nothing here (`user`, `metadata`, ...) are ignored. vLLM's `min_p` and
`repetition_penalty` are taken; sampling controls this server does not implement (presence and frequency
penalties, `logit_bias`) are refused with a 400 unless they hold their neutral value, as are `stream`, `echo` and `best_of` > 1: ignoring them would change what the caller
receives without saying so. Token strings in log-prob entries are
each token decoded on its own, so a character split across tokens shows as replacement characters.

A chat request's `chat_template_kwargs` (vLLM's: `{"enable_thinking": false}` for Qwen3) are variables of the chat
template for that request alone, over the server's `--default_chat_template_kwargs` (bound to its tokenizer at
start): a per-request view of the tokenizer passes them, so concurrent requests never see each other's.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from alignrl.serve.common import RequestError, unicode_texts
from alignrl.serve.gen_types import MAX_N, MAX_STOP_LEN, MAX_STOPS, GenRow, sampling


# Sampling controls not implemented, and the value that leaves sampling as it is (the `openai` client's and
# vLLM's defaults): any other value is refused rather than ignored.
UNIMPLEMENTED = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}}


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    model: str = ""
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # vLLM's extra sampling parameters
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, data):
        """The `openai` client sends null for a parameter given as None (max_tokens=None, say); OpenAI and vLLM
        read it as not given. Unimplemented sampling controls off their neutral value are refused."""
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if v is not None}
        for key, neutral in UNIMPLEMENTED.items():
            if key in data and data[key] != neutral:
                raise ValueError(f"{key}={data[key]!r} is not supported by this server; leave it out")
        return data

    @model_validator(mode="after")
    def _supported(self):
        if self.stream:
            raise ValueError("stream=true is not supported by this server; send stream=false")
        stops = self.stop_list()
        if len(stops) > MAX_STOPS or any(not s or len(s) > MAX_STOP_LEN for s in stops):
            raise ValueError(f"stop takes up to {MAX_STOPS} strings of 1..{MAX_STOP_LEN} characters")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Sampling):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=1)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    url: str  # a data: URL (base64), a file:// URL or a local path on the server


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content if isinstance(p, TextPart))

    def images(self) -> list[str]:
        return [] if isinstance(self.content, str) else [p.image_url.url for p in self.content
                                                         if isinstance(p, ImagePart)]


# apply_chat_template's own arguments: given as template variables they would change what the server renders
# (tokenize, add_generation_prompt), swap its template, or clash with the call (conversation)
NOT_VARIABLES = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                           "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                           "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
                           "processor_kwargs"})


def template_variables(value: Any, what: str) -> dict[str, Any]:
    """`value` as the variables of a chat template (a JSON object of names to values); ValueError naming `what`
    otherwise. JSON object keys are always text, so only the reserved names can be wrong among them."""
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object of template variables, e.g. {{\"enable_thinking\": false}}; "
                         f"got {type(value).__name__}")
    taken = sorted(NOT_VARIABLES.intersection(value))
    if taken:
        raise ValueError(f"{what} names {', '.join(taken)}: argument(s) of apply_chat_template itself, not variables "
                         "of the template; leave them out")
    return value


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: Any = None  # checked below: pydantic's own message would not say what the field holds

    @field_validator("chat_template_kwargs")
    @classmethod
    def _variables(cls, value: Any) -> dict[str, Any]:
        return {} if value is None else template_variables(value, "chat_template_kwargs")


class TemplateView:
    """`inner` (a tokenizer, or the processor a vision-language model's carries) whose `apply_chat_template` renders
    with `variables` unless a call sets them: one request's view, leaving the shared tokenizer as it is. Everything
    else is the inner object's."""

    def __init__(self, inner, variables: dict[str, Any]):
        self._inner, self._variables = inner, variables

    def apply_chat_template(self, *args, **kwargs):
        return self._inner.apply_chat_template(*args, **{**self._variables, **kwargs})

    def __call__(self, *args, **kwargs):
        return self._inner(*args, **kwargs)

    def __getattr__(self, name: str):
        from alignrl.data.images import PROCESSOR_ATTR

        value = getattr(self._inner, name)
        return TemplateView(value, self._variables) if name == PROCESSOR_ATTR and value is not None else value


def params_of(req: _Sampling, max_tokens: int):
    return sampling(req.n, req.temperature, req.top_p, req.top_k, max_tokens, req.stop_list(), req.seed, req.min_p,
                    req.repetition_penalty)


# Characters per token that a text longer than the context is tried at: ordinary text runs 3-6 to a token.
PREFIX_CHARS_PER_TOKEN = 32


def refuse_overlong(tokenizer, text: str, max_model_len: int, what: str) -> None:
    """Refuses a text whose beginning alone is longer than the context, before the whole of it is tokenized: a
    request body may carry megabytes of text, which would otherwise cost the server seconds to find too long.
    Exact: only a prefix that already holds more tokens than the context refuses (a token or two of slack for
    the cut); a shorter prefix (text that tokenizes very densely) leaves the full check to the caller."""
    cut = (max_model_len + 1) * PREFIX_CHARS_PER_TOKEN
    if len(text) > cut and len(tokenizer.encode(text[:cut], add_special_tokens=False)) > max_model_len + 2:
        raise RequestError(f"{what} has more tokens than the model's context of {max_model_len} (its first {cut} "
                           "characters alone do); shorten it")


def completion_prompts(req: CompletionRequest, tokenizer, max_model_len: int) -> list[list[int]]:
    if req.echo:
        raise RequestError("echo=true is not supported; send echo=false")
    p = req.prompt
    if isinstance(p, str):
        p = [p]
    if not p:
        raise RequestError("prompt is empty; send a string, a list of strings or token ids")
    if isinstance(p[0], str):
        texts = unicode_texts(p, "prompt")
        for i, s in enumerate(texts):
            refuse_overlong(tokenizer, s, max_model_len, f"prompt {i}")
        return [tokenizer.encode(s) for s in texts]
    return [list(x) for x in p] if isinstance(p[0], list) else [list(p)]


def image_chat_prompt(req: ChatRequest, tokenizer, max_model_len: int) -> list[int]:
    """The prompt of messages with `image_url` parts: the images (data: URLs, file:// URLs or paths on this
    server) decoded and expanded into image tokens by a vision-language model's processor (`data.images`)."""
    from alignrl.data.images import ImageDataError, encode_image_prompt, image_source
    from alignrl.data.records import Sample

    msgs = [{"role": m.role, "content": m.text() if isinstance(m.content, str) else
             [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"} for p in m.content]}
            for m in req.messages]
    try:
        sources = tuple(image_source(f"image {i}", url, None)
                        for i, url in enumerate(u for m in req.messages for u in m.images()))
        ids = encode_image_prompt(tokenizer, Sample(msgs, "", images=sources, source="the request"), 1 << 30)
    except ImageDataError as e:
        raise RequestError(str(e)) from None
    if len(ids) > max_model_len:
        raise RequestError(f"the messages with their images are {len(ids)} tokens, longer than the model's context "
                           f"of {max_model_len}; send fewer or smaller images, or less text")
    return ids


def chat_prompt(req: ChatRequest, tokenizer, max_model_len: int) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model's tokenizer has no chat template; use /v1/completions with a text prompt")
    if req.chat_template_kwargs:
        tokenizer = TemplateView(tokenizer, req.chat_template_kwargs)
    if any(m.images() for m in req.messages):
        from alignrl.data.images import PROCESSOR_ATTR

        if getattr(tokenizer, PROCESSOR_ATTR, None) is None:
            raise RequestError("image_url content needs a vision-language model; this server's model is text-only: "
                               "send text only, or serve a vision-language model (alignrl serve generate --model)")
        return image_chat_prompt(req, tokenizer, max_model_len)
    msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
    unicode_texts([m["content"] for m in msgs], "message")
    # the template only adds text around the contents: their tokens alone bound the prompt's from below
    refuse_overlong(tokenizer, "\n".join(m["content"] for m in msgs), max_model_len, "the messages' text")
    try:
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # noqa: BLE001 - a template may raise on any message order it dislikes
        raise RequestError(f"the chat template rejected these messages: {str(e).splitlines()[0] if str(e) else e!r}")
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _pieces(tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode([t], skip_special_tokens=True) for t in ids]


def _finish(tokenizer, row: GenRow, stop: list[str]) -> tuple[str, int, str]:
    """(text without the stop string, tokens that text came from, finish reason)."""
    text = tokenizer.decode(row.token_ids, skip_special_tokens=True)
    hits = [text.find(s) for s in stop if s in text]
    if not hits:
        return text, len(row.token_ids), row.finish_reason
    cut = min(hits)
    kept = text[:cut]
    # the fewest tokens whose text holds the kept text: decoded as a prefix, not token by token, where a character
    # split over byte-level tokens would count as two replacement characters
    ids = row.token_ids
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if tokenizer.decode(ids[:mid], skip_special_tokens=True).startswith(kept):
            hi = mid
        else:
            lo = mid + 1
    return kept, lo, "stop"


def _usage(prompts: list[list[int]], rows: list[GenRow]) -> dict:
    p, c = sum(len(x) for x in prompts), sum(len(r.token_ids) for r in rows)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _top(tokenizer, row: GenRow, t: int) -> list[tuple[int, float]]:
    """Alternatives at position t, always including the sampled token (at least its log-prob)."""
    alts = list(row.top[t]) if row.top else []
    if all(tid != row.token_ids[t] for tid, _ in alts):
        alts.append((row.token_ids[t], row.logprobs[t]))
    return alts


def completion_response(req: CompletionRequest, model: str, tokenizer, prompts: list[list[int]],
                        rows: list[GenRow]) -> dict:
    choices = []
    for i, row in enumerate(rows):
        text, kept, reason = _finish(tokenizer, row, req.stop_list())
        lp = None
        if req.logprobs is not None:
            pieces = _pieces(tokenizer, row.token_ids[:kept])
            offsets = [sum(len(x) for x in pieces[:j]) for j in range(kept)]
            lp = {"tokens": pieces, "token_logprobs": row.logprobs[:kept], "text_offset": offsets,
                  "top_logprobs": [{tokenizer.decode([tid], skip_special_tokens=True): v
                                    for tid, v in _top(tokenizer, row, t)[:max(1, req.logprobs) + 1]}
                                   for t in range(kept)]}
        choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": reason})
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": _usage(prompts, rows)}


def _token_entry(tokenizer, tid: int, lp: float) -> dict:
    s = tokenizer.decode([tid], skip_special_tokens=True)
    return {"token": s, "logprob": lp, "bytes": list(s.encode())}


def chat_response(req: ChatRequest, model: str, tokenizer, prompt: list[int], rows: list[GenRow]) -> dict:
    choices = []
    for i, row in enumerate(rows):
        text, kept, reason = _finish(tokenizer, row, req.stop_list())
        lp = None
        if req.logprobs:
            k = req.top_logprobs or 0
            lp = {"content": [{**_token_entry(tokenizer, row.token_ids[t], row.logprobs[t]),
                               "top_logprobs": [_token_entry(tokenizer, a, v) for a, v in (row.top[t][:k]
                                                                                          if row.top else [])]}
                              for t in range(kept)]}
        choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                        "finish_reason": reason})
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": _usage([prompt], rows)}


def model_list(name: str, max_model_len: int) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                        "owned_by": "alignrl", "max_model_len": max_model_len}]}


def check_model(req: _Sampling, served: str) -> None:
    """A request naming another model than the one served is a 404, as vLLM answers it (the client would otherwise
    take this model's text for that one's); no name, or this one's, is served."""
    if req.model and req.model != served:
        raise RequestError(f"The model `{req.model}` does not exist: this server serves `{served}` (GET /v1/models; "
                           "alignrl serve generate --served_model_name sets it)", 404)


def add_routes(app, svc) -> None:
    """`/v1/models`, `/v1/completions`, `/v1/chat/completions` over a GenerationService."""

    @app.get("/v1/models")
    async def models() -> dict:
        return model_list(svc.model_name, svc.limits.max_model_len)

    # tokenizing runs off the event loop: a long prompt must not stall /health and every other request
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> dict:
        check_model(req, svc.model_name)
        prompts = await asyncio.to_thread(completion_prompts, req, svc.tokenizer, svc.limits.max_model_len)
        res = await svc.generate(prompts, params_of(req, req.max_tokens), req.logprobs or 0)
        return completion_response(req, svc.model_name, svc.tokenizer, prompts, res.rows)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest) -> dict:
        check_model(req, svc.model_name)
        prompt = await asyncio.to_thread(chat_prompt, req, svc.tokenizer, svc.limits.max_model_len)
        k = (req.top_logprobs or 0) if req.logprobs else 0
        # Like vLLM, no max_tokens means "up to the context", capped to keep one request's cost bounded.
        max_tokens = (req.max_completion_tokens or req.max_tokens
                      or max(1, min(1024, svc.limits.max_model_len - len(prompt))))
        res = await svc.generate([prompt], params_of(req, max_tokens), k)
        return chat_response(req, svc.model_name, svc.tokenizer, prompt, res.rows)
