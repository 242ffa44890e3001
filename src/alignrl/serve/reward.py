"""Reward-model server: one scalar score per (prompt, response) from a sequence-classification model.

    alignrl serve reward --model RM_PATH --port 8002

`POST /v1/score` takes `{"prompts": [...], "responses": [...]}`, either both lists of strings or both
lists of token-id lists, and returns `{"scores": [float, ...]}`. Text is tokenized as given, without
special tokens or a chat template: apply the template the reward model was trained with before
sending, or send the token ids the policy produced (then the score equals the in-process
`models.value.ModelScorer` on the same rollout). `GET /health`, `GET /v1/stats`.

    alignrl serve reward --protocol openrlhf --dataset FILE --input_key message --prompt-template chatml

serves a rule reward (R1 format + math accuracy) on OpenRLHF's `POST /get_reward` instead: `serve.rule_reward`.

Deliberately left out: pairwise comparison endpoints, per-token rewards.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from alignrl.serve.batcher import Batcher, flat_pairs, per_job
from alignrl.serve.common import (RequestError, base_parser, check_args, device_of, fail, new_app, start,
                                  unicode_texts)
from alignrl.serve.ref import check_pairs

PROG = "alignrl serve reward"


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    prompts: list[str] | list[list[StrictInt]] = Field(min_length=1)
    responses: list[str] | list[list[StrictInt]] = Field(min_length=1)

    @model_validator(mode="after")
    def _same_form(self):
        if isinstance(self.prompts[0], str) != isinstance(self.responses[0], str):
            raise ValueError("prompts and responses must both be strings or both be token-id lists")
        return self


@dataclass
class RewardService:
    scorer: object  # models.value.ModelScorer
    tokenizer: object | None
    pad_id: int
    vocab_size: int
    max_model_len: int
    max_request_seqs: int
    micro_batch: int = 64
    max_batch: int = 256
    window_s: float = 0.005

    def __post_init__(self) -> None:
        self.batcher = Batcher(self._run, self.window_s, self.max_batch)

    def _run(self, _key: str, jobs: list[tuple[list, list]]) -> list[list[float]]:
        from alignrl.data.collate import left_pad, right_pad

        prompts, responses = flat_pairs(jobs)
        scores: list[float] = []
        for s in range(0, len(prompts), self.micro_batch):
            pids, pm = left_pad(prompts[s:s + self.micro_batch], self.pad_id)
            rids, rm = right_pad(responses[s:s + self.micro_batch], self.pad_id)
            scores += self.scorer.score(pids, pm, rids, rm).tolist()
        return per_job(scores, jobs)

    def _ids(self, texts: list[str]) -> list[list[int]]:
        if self.tokenizer is None:
            raise RequestError("this reward model folder has no tokenizer; send token ids instead of text")
        return [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in unicode_texts(texts, "text")]

    async def score(self, req: ScoreRequest) -> list[float]:
        prompts, responses = req.prompts, req.responses
        if isinstance(prompts[0], str):
            prompts, responses = self._ids(prompts), self._ids(responses)
        check_pairs(prompts, responses, self.vocab_size, self.max_model_len, self.max_request_seqs)
        return await self.batcher.submit("score", (prompts, responses), len(prompts))


def build_app(svc: RewardService, max_body: int):
    app = new_app("alignrl reward model", "reward", max_body)

    @app.post("/v1/score")
    async def score(req: ScoreRequest) -> dict:
        return {"scores": await svc.score(req)}

    @app.get("/v1/stats")
    async def stats() -> dict:
        return svc.batcher.stats.as_dict()

    return app


def parser() -> argparse.ArgumentParser:
    p = base_parser(PROG, "reward-model scoring server", 8002)
    p.add_argument("--micro_batch", type=int, default=64, help="rows per forward pass")
    p.add_argument("--protocol", choices=["alignrl", "openrlhf"], default="alignrl",
                   help="openrlhf: a rule reward on OpenRLHF's POST /get_reward instead of a model (see its --help)")
    return p


def load_service(args: argparse.Namespace) -> RewardService:
    from alignrl.models.value import ModelScorer

    log = lambda *a: print(*a, file=sys.stderr)  # noqa: E731
    scorer = ModelScorer(args.model, args.dtype, log=log, device=device_of(args))
    try:
        from transformers import AutoTokenizer

        from alignrl.models.loader import resolve_model_path

        tok = AutoTokenizer.from_pretrained(str(resolve_model_path(args.model, log)))
    except (OSError, ValueError):  # a folder without tokenizer files: token-id requests still work
        tok = None
    cfg = scorer.model.config
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (tok.pad_token_id if tok else None) or 0
    return RewardService(scorer, tok, pad, scorer.model.get_input_embeddings().num_embeddings,
                         getattr(cfg, "max_position_embeddings", 4096), args.max_request_seqs, args.micro_batch,
                         args.max_batch, args.batch_window_ms / 1000)


def protocol_of(argv: list[str]) -> tuple[str, list[str]]:
    """`--protocol NAME` (or `--protocol=NAME`) taken out of `argv`: "alignrl" (a reward model on /v1/score, the
    default) or "openrlhf" (a rule reward on /get_reward)."""
    rest, protocol, i = [], "alignrl", 0
    while i < len(argv):
        if argv[i] == "--protocol" and i + 1 < len(argv):
            protocol, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith("--protocol="):
            protocol = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    return protocol, rest


def main(argv: list[str]) -> int:
    protocol, argv = protocol_of(list(argv))
    if protocol == "openrlhf":
        from alignrl.serve import rule_reward

        return rule_reward.main(argv)
    if protocol != "alignrl":
        return fail(PROG, f"--protocol {protocol!r} is unknown; pass alignrl (a reward model on /v1/score) or "
                          "openrlhf (a rule reward on /get_reward, with --dataset)")
    args = parser().parse_args(argv)
    problem = check_args(args)
    if problem:
        return fail(PROG, problem)
    return start("reward", args, load_service, build_app)
