"""Reference-model server: per-token log-probs of responses under a frozen model.

    alignrl serve ref --model PATH --port 8001

`POST /v1/logprobs` takes `{"prompts": [[ids]...], "responses": [[ids]...], "temperature": 1.0}` and
returns `{"logprobs": [[float per response token]...]}`: row i has exactly len(responses[i]) values,
computed as the in-process reference (`models.logprobs.response_logprobs` on left-padded prompts and
right-padded responses, length-grouped micro-batches), so a trainer gets the same numbers remote or
local. Concurrent requests at one temperature are batched. `GET /health`, `GET /v1/stats`.
Deliberately left out: weight updates (the reference is frozen by definition), entropy output.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from alignrl.serve.batcher import Batcher, flat_pairs, per_job
from alignrl.serve.common import RequestError, base_parser, check_args, device_of, fail, new_app, start

PROG = "alignrl serve ref"


class LogprobsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    prompts: list[list[StrictInt]] = Field(min_length=1)
    responses: list[list[StrictInt]] = Field(min_length=1)
    temperature: float = Field(1.0, gt=0.0, le=100.0)


def check_pairs(prompts, responses, vocab_size: int, max_len: int, max_rows: int, need_prompt: bool = True) -> None:
    """Shared by the ref and reward servers: one-line 400s naming the first bad row."""
    if len(prompts) != len(responses):
        raise RequestError(f"{len(prompts)} prompts but {len(responses)} responses; send one response per prompt")
    if len(prompts) > max_rows:
        raise RequestError(f"{len(prompts)} rows exceeds this server's limit of {max_rows} per request; split it")
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if need_prompt and not p:
            raise RequestError(f"prompt {i} is empty; every prompt needs at least one token")
        bad = next((t for t in (*p, *r) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(f"row {i} has token id {bad}, outside this model's vocabulary [0, {vocab_size}); "
                               "tokenize with the served model's tokenizer")
        if len(p) + len(r) > max_len:
            raise RequestError(f"row {i} has {len(p) + len(r)} tokens, more than the model's context of {max_len}")


@dataclass
class RefService:
    model: object
    pad_id: int
    vocab_size: int
    max_model_len: int
    max_request_seqs: int
    micro_batch: int = 64
    max_batch: int = 256
    window_s: float = 0.005

    def __post_init__(self) -> None:
        self.batcher = Batcher(self._run, self.window_s, self.max_batch)

    def _run(self, temperature: float, jobs: list[tuple[list, list]]) -> list[list[list[float]]]:
        from alignrl.data.collate import left_pad, per_token_in_chunks, right_pad
        from alignrl.models.logprobs import response_logprobs

        prompts, responses = flat_pairs(jobs)
        pids, pm = left_pad(prompts, self.pad_id)
        rids, rm = right_pad(responses, self.pad_id)
        dev = next(self.model.parameters()).device

        def fn(m, *tensors):
            return response_logprobs(m, *(t.to(dev) for t in tensors), temperature=temperature)[0].cpu()

        lp = per_token_in_chunks(self.model, fn, pids, pm, rids, rm, self.micro_batch)
        return per_job([lp[i, :len(r)].tolist() for i, r in enumerate(responses)], jobs)

    async def logprobs(self, req: LogprobsRequest) -> list[list[float]]:
        check_pairs(req.prompts, req.responses, self.vocab_size, self.max_model_len, self.max_request_seqs)
        return await self.batcher.submit(req.temperature, (req.prompts, req.responses), len(req.prompts))


def build_app(svc: RefService, max_body: int):
    app = new_app("alignrl reference log-probs", "reference", max_body)

    @app.post("/v1/logprobs")
    async def logprobs(req: LogprobsRequest) -> dict:
        return {"logprobs": await svc.logprobs(req)}

    @app.get("/v1/stats")
    async def stats() -> dict:
        return svc.batcher.stats.as_dict()

    return app


def parser() -> argparse.ArgumentParser:
    p = base_parser(PROG, "reference-model log-prob server", 8001)
    p.add_argument("--tensor_parallel_size", type=int, default=1,
                   help="accepted for the seed's launcher; this server runs the model on one device")
    p.add_argument("--micro_batch", type=int, default=64, help="rows per forward pass")
    return p


def load_service(args: argparse.Namespace) -> RefService:
    from alignrl.models.loader import load_model

    model, tok = load_model(args.model, args.dtype, log=lambda *a: print(*a, file=sys.stderr), chat=False,
                            key="--model")
    model = model.to(device_of(args)).eval().requires_grad_(False)
    cfg = model.config
    return RefService(model, tok.pad_token_id, model.get_input_embeddings().num_embeddings,
                      getattr(cfg, "max_position_embeddings", 4096), args.max_request_seqs, args.micro_batch,
                      args.max_batch, args.batch_window_ms / 1000)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    problem = check_args(args)
    if problem:
        return fail(PROG, problem)
    if args.tensor_parallel_size > 1:  # the seed's launcher passes 8: say what it does here, once
        print(f"{PROG}: --tensor_parallel_size {args.tensor_parallel_size} not used: this server runs the model on "
              "one device (the reference is a forward pass; run more servers to spread the load)", file=sys.stderr)
    return start("ref", args, load_service, build_app)
