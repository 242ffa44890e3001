"""A reward model served on OpenRLHF's remote reward protocol, in place of `python -m openrlhf.cli.serve_rm`:

    alignrl serve reward --protocol openrlhf --reward_pretrain RM_FOLDER [--normalize_reward] [--max_len 2048]
        [--batch_size N] [--bf16] [--port 5000]

`POST /get_reward` takes `{"query": [texts...]}` (other fields, such as `prompts` and `labels`, are ignored) and
answers `{"rewards": [floats...]}`, one per query, as OpenRLHF's server does: each query loses the pad and eos
tokens at its two ends and gets one eos appended; it is tokenized as the reward model's tokenizer does by default
(its special tokens, such as a BOS, added), truncated to its first --max_len tokens (a longer query is cut, not
refused), and scored at its last token (`models.value.ModelScorer`); --normalize_reward scores
(score - mean) / std with the mean and std of the folder's config.json. A run points at it with
`services.reward_url=http://127.0.0.1:5000/get_reward` (OpenRLHF's `--remote_rm_url`). `GET /health`,
`GET /v1/stats`.

One difference on purpose: OpenRLHF strips the pad and eos texts with `str.strip`, which removes any of their
*characters* (a query ending in "done" before `<|im_end|>` loses its "d", "n" and "e"); here only whole
occurrences of the tokens are removed.

The model is a Hugging Face sequence-classification folder or one OpenRLHF's reward trainer saved (its head as
`value_head` or `score`, `models.value`). `--flash_attn` is accepted and not used (transformers' default attention
runs); `--load_in_4bit` is refused.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from alignrl.serve.batcher import Batcher, per_job
from alignrl.serve.common import (RequestError, check_args, device_of, fail, new_app, serving_flags, start,
                                  unicode_texts)

PROG = "alignrl serve reward --protocol openrlhf"
HEADS = ("value_head", "score")  # OpenRLHF's default name, and the one transformers' classification models use


class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenRLHF's trainer sends prompts and labels too; its server reads query

    query: list[StrictStr] = Field(min_length=1)


def stripped(text: str, tokens: list[str]) -> str:
    """`text` without any run of whole `tokens` at either end (the padding and end-of-sequence markers a decoded
    rollout may carry)."""
    changed = True
    while changed and text:
        changed = False
        for token in tokens:
            if text.startswith(token):
                text, changed = text[len(token):], True
            if text.endswith(token):
                text, changed = text[:-len(token)], True
    return text


@dataclass
class OpenRLHFRewardModel:
    """The reward model and its tokenizer behind `/get_reward`: concurrent requests are scored together in
    forward passes of at most `batch_size` queries."""

    scorer: object  # models.value.ModelScorer
    tokenizer: object
    max_len: int
    batch_size: int
    max_request_seqs: int = 1024
    window_s: float = 0.005
    max_batch: int = 256
    pad_id: int = field(init=False)

    def __post_init__(self) -> None:
        tok = self.tokenizer
        # OpenRLHF's tokenizer pads with eos when the model names no pad token; the strip follows it
        self.eos = tok.eos_token or ""
        self.pad = tok.pad_token or self.eos
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.pad_id = pad_id if pad_id is not None else 0
        self.batcher = Batcher(self._run, self.window_s, self.max_batch)

    def query_ids(self, queries: list[str]) -> list[list[int]]:
        """Each query's token ids as OpenRLHF's server feeds them to its model."""
        ends = [t for t in (self.pad, self.eos) if t]
        texts = [stripped(q, ends) + self.eos for q in unicode_texts(queries, "query")]
        ids = self.tokenizer(texts, truncation=True, max_length=self.max_len)["input_ids"]
        empty = next((i for i, row in enumerate(ids) if not row), None)
        if empty is not None:  # only without an eos token to append: no position to read a score at
            raise RequestError(f"query {empty} has no tokens once its padding is removed; send non-empty text")
        return ids

    def _run(self, _key: str, jobs: list[list[list[int]]]) -> list[list[float]]:
        from alignrl.data.collate import left_pad

        rows = [row for job in jobs for row in job]
        scores: list[float] = []
        for s in range(0, len(rows), self.batch_size):
            ids, mask = left_pad(rows[s:s + self.batch_size], self.pad_id)
            # the whole query goes in as the "prompt": its last token is where ModelScorer reads the score
            empty = ids[:, :0]
            scores += self.scorer.score(ids, mask, empty, mask[:, :0]).tolist()
        return per_job(scores, [(job, job) for job in jobs])

    async def rewards(self, req: RewardRequest) -> list[float]:
        if len(req.query) > self.max_request_seqs:
            raise RequestError(f"{len(req.query)} queries in one request; send at most {self.max_request_seqs} "
                               "(or start the server with a larger --max_request_seqs)", 413)
        ids = self.query_ids(list(req.query))
        return await self.batcher.submit("score", ids, len(ids))


def build_app(svc: OpenRLHFRewardModel, max_body: int):
    app = new_app("alignrl reward model (OpenRLHF protocol)", "reward", max_body)

    @app.post("/get_reward")
    async def get_reward(req: RewardRequest) -> dict:
        return {"rewards": await svc.rewards(req)}

    @app.get("/v1/stats")
    async def stats() -> dict:
        return svc.batcher.stats.as_dict()

    return app


def parser() -> argparse.ArgumentParser:
    from alignrl.runtime.one_line import OneLineParser

    p = OneLineParser(prog=PROG, description="reward-model server on OpenRLHF's POST /get_reward "
                      "(openrlhf.cli.serve_rm's flags)")
    p.add_argument("--reward_pretrain", required=True, help="the reward model: a sequence-classification folder, or "
                   "one OpenRLHF saved")
    p.add_argument("--normalize_reward", action="store_true", help="(score - mean) / std of its config.json")
    p.add_argument("--value_head_prefix", default="value_head", help="the head's name in the folder: value_head or "
                   "score, both found without it")
    p.add_argument("--max_len", type=int, default=2048, help="a query keeps its first N tokens")
    p.add_argument("--batch_size", type=int, default=None,
                   help="most queries in one forward pass (default: --max_batch)")
    p.add_argument("--bf16", action="store_true", help="run the model in bfloat16 (default float32)")
    p.add_argument("--flash_attn", action="store_true", help="accepted; transformers' default attention runs")
    p.add_argument("--load_in_4bit", action="store_true", help="refused: the reward server loads unquantized")
    p.add_argument("--disable_fast_tokenizer", action="store_true", help="load the slow (Python) tokenizer")
    serving_flags(p, 5000)  # OpenRLHF's default port
    return p


def flag_problem(args: argparse.Namespace) -> str | None:
    """The first of OpenRLHF's flags alignrl cannot honour, or a bad value, as one line; None when all are fine."""
    if args.load_in_4bit:
        return ("--load_in_4bit: 4-bit loading is not supported by the reward server (alignrl quantizes only a "
                "base that LoRA adapters train on, and a served reward model trains nothing); drop it (--bf16 halves "
                "the memory of float32)")
    if args.value_head_prefix not in HEADS:
        return (f"--value_head_prefix {args.value_head_prefix}: alignrl reads a head named value_head (OpenRLHF's) "
                "or score (transformers'); drop the flag, and save the model with its head weight under one of them")
    if args.max_len < 1:
        return "--max_len must be at least 1"
    if args.batch_size is not None and args.batch_size < 1:
        return "--batch_size must be at least 1 (leave it out: --max_batch queries a forward pass)"
    return check_args(args)


def load_service(args: argparse.Namespace) -> OpenRLHFRewardModel:
    from transformers import AutoTokenizer

    from alignrl.models.folder import ModelError
    from alignrl.models.loader import resolve_model_path
    from alignrl.models.value import ModelScorer

    log = lambda *a: print(*a, file=sys.stderr)  # noqa: E731
    if args.flash_attn:
        log(f"{PROG}: --flash_attn is not used: the model runs with transformers' default attention (SDPA)")
    folder = resolve_model_path(args.reward_pretrain, log, "--reward_pretrain")
    scorer = ModelScorer(str(folder), "bfloat16" if args.bf16 else "float32", log=log, device=device_of(args),
                         normalize=args.normalize_reward)
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), use_fast=not args.disable_fast_tokenizer)
    except (OSError, ValueError) as e:
        raise ModelError(f"--reward_pretrain {args.reward_pretrain} has no tokenizer this server can load "
                         f"({type(e).__name__}); save the reward model's tokenizer in its folder") from None
    context = getattr(scorer.model.config, "max_position_embeddings", None)
    max_len = args.max_len
    if context and max_len > context:  # positions past the model's context would fail inside the forward
        log(f"{PROG}: --max_len {max_len} exceeds the model's context ({context} tokens): queries keep {context}")
        max_len = context
    return OpenRLHFRewardModel(scorer, tok, max_len, args.batch_size or args.max_batch, args.max_request_seqs,
                               args.batch_window_ms / 1000, args.max_batch)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    problem = flag_problem(args)
    if problem:
        return fail(PROG, problem)
    return start("reward", args, load_service, build_app)
