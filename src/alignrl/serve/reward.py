"""Reward-model server: one scalar score per (prompt, response) from a sequence-classification model.

    alignrl serve reward --model RM_PATH --port 8002

`POST /v1/score` takes `{"prompts": [...], "responses": [...]}`, either both lists of strings or both
lists of token-id lists, and returns `{"scores": [float, ...]}`. Text is tokenized as given, without
special tokens or a chat template: apply the template the reward model was trained with before
sending, or send the token ids the policy produced (then the score equals the in-process
`models.value.ModelScorer` on the same rollout). `GET /health`, `GET /v1/stats`.

    alignrl serve reward --model RM_PATH --input_tokenizer POLICY_PATH [--max_length N]

serves a reward model of its own tokenizer (verl's reward_model.model.input_tokenizer): requests send the policy's
token ids with each row's prompt `messages`; each response is decoded with the policy's tokenizer and the
conversation scored in the reward model's chat template (`models.rm_template`), its first N tokens (default: the
model's context). A run sends them so with `algorithm.reward_model_retemplate=true` and `services.reward_url`.

    alignrl serve reward --protocol openrlhf --dataset FILE --input_key message --prompt-template chatml

serves a rule reward (R1 format + math accuracy) on OpenRLHF's `POST /get_reward` instead: `serve.rule_reward`;
with `--reward_pretrain RM_FOLDER` in place of the dataset, a reward model as `openrlhf.cli.serve_rm` serves it:
`serve.openrlhf_rm`. `--normalize_reward` scores (score - mean) / std of the model folder's config.json.

Deliberately left out: pairwise comparison endpoints, per-token rewards.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from alignrl.errors import UserError
from alignrl.serve.batcher import Batcher, flat_pairs, per_job
from alignrl.serve.common import (RequestError, base_parser, check_args, device_of, fail, new_app, start,
                                  unicode_texts)
from alignrl.serve.ref import check_pairs

PROG = "alignrl serve reward"


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    prompts: list[str] | list[list[StrictInt]] = Field(min_length=1)
    responses: list[str] | list[list[StrictInt]] = Field(min_length=1)
    # each row's prompt as chat messages (--input_tokenizer); a message's content may be a list of parts, and a
    # message may carry tool calls, as chat templates take them
    messages: list[list[dict[str, Any]]] | None = None

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
    policy_tokenizer: object | None = None  # --input_tokenizer: rows come as the policy's ids with their messages
    template: object | None = None  # models.rm_template.RmTemplate; None: the reward model reads the policy's ids

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

    def _retemplated(self, req: ScoreRequest) -> tuple[list[list[int]], list[list[int]]]:
        """The rows in the reward model's own ids (each a whole conversation, scored as a prompt alone)."""
        from alignrl.models.rm_template import row_ids

        if req.messages is None or isinstance(req.responses[0], str):
            raise RequestError("this reward service re-templates (--input_tokenizer): send the policy's token ids "
                               "with each row's prompt as chat messages (\"messages\")")
        if len(req.messages) != len(req.responses):
            raise RequestError(f"{len(req.messages)} rows of messages but {len(req.responses)} responses; send one "
                               "per row")
        size = len(self.policy_tokenizer)
        for i, r in enumerate(req.responses):
            bad = next((t for t in r if not 0 <= t < size), None)
            if bad is not None:
                raise RequestError(f"row {i} has token id {bad}, outside the policy's vocabulary [0, {size})")
        try:
            rows = [row_ids(self.policy_tokenizer, self.template, m, r) for m, r in zip(req.messages, req.responses)]
        except UserError as e:  # a row the reward model's chat template cannot render: the request's, not ours
            raise RequestError(str(e), 422) from None
        return rows, [[] for _ in rows]

    async def score(self, req: ScoreRequest) -> list[float]:
        prompts, responses = req.prompts, req.responses
        if req.messages is not None and self.policy_tokenizer is None:
            raise RequestError("this reward service scores token ids as sent; start it with --input_tokenizer "
                               "POLICY_FOLDER to score rows with messages in its own chat template")
        if self.template is not None:
            prompts, responses = self._retemplated(req)
        elif isinstance(prompts[0], str):
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
    p.add_argument("--input_tokenizer", default="", help="the policy's model folder: rows come as its token ids with "
                   "their prompt messages and are scored in this model's chat template (verl's "
                   "reward_model.model.input_tokenizer); a model of the policy's tokenizer scores the ids")
    p.add_argument("--max_length", type=int, default=0, help="with --input_tokenizer: a conversation keeps its first "
                   "N tokens (verl's reward_model.max_length); 0: the model's context")
    p.add_argument("--normalize_reward", action="store_true",
                   help="scores as (score - mean) / std with the mean and std of the model folder's config.json")
    p.add_argument("--protocol", choices=["alignrl", "openrlhf"], default="alignrl",
                   help="openrlhf: OpenRLHF's POST /get_reward, a reward model with --reward_pretrain or a rule "
                   "reward with --dataset (see its --help)")
    return p


def load_service(args: argparse.Namespace) -> RewardService:
    from alignrl.models.value import ModelScorer

    log = lambda *a: print(*a, file=sys.stderr)  # noqa: E731
    scorer = ModelScorer(args.model, args.dtype, log=log, device=device_of(args), normalize=args.normalize_reward)
    try:
        from transformers import AutoTokenizer

        from alignrl.models.loader import resolve_model_path

        tok = AutoTokenizer.from_pretrained(str(resolve_model_path(args.model, log)))
    except (OSError, ValueError):  # a folder without tokenizer files: token-id requests still work
        tok = None
    cfg = scorer.model.config
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (tok.pad_token_id if tok else None) or 0
    context = getattr(cfg, "max_position_embeddings", 4096)
    policy, template = input_template(args, context, log)
    return RewardService(scorer, tok, pad, scorer.model.get_input_embeddings().num_embeddings, context,
                         args.max_request_seqs, args.micro_batch, args.max_batch, args.batch_window_ms / 1000,
                         policy, template)


def input_template(args: argparse.Namespace, context: int, log) -> tuple[object | None, object | None]:
    """(the policy's tokenizer, the reward model's RmTemplate) of --input_tokenizer; (None, None) without it."""
    if not args.input_tokenizer:
        return None, None
    from alignrl.models.loader import load_tokenizer, resolve_model_path
    from alignrl.models.rm_template import reward_input

    policy = load_tokenizer(resolve_model_path(args.input_tokenizer, log, "--input_tokenizer"), chat=False)
    return policy, reward_input(policy, resolve_model_path(args.model, log, "--model"), True,
                                min(args.max_length or context, context), key="--model", flag="--input_tokenizer")


def protocol_of(argv: list[str]) -> tuple[str, list[str]]:
    """`--protocol NAME` (or `--protocol=NAME`) taken out of `argv`: "alignrl" (a reward model on /v1/score, the
    default) or "openrlhf" (OpenRLHF's /get_reward: a reward model or a rule reward)."""
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
        # a model (OpenRLHF's serve_rm) when its folder is given, else the rule reward (LMM-R1's math_verifier)
        if any(a == "--reward_pretrain" or a.startswith("--reward_pretrain=") for a in argv):
            from alignrl.serve import openrlhf_rm

            return openrlhf_rm.main(argv)
        from alignrl.serve import rule_reward

        return rule_reward.main(argv)
    if protocol != "alignrl":
        return fail(PROG, f"--protocol {protocol!r} is unknown; pass alignrl (a reward model on /v1/score) or "
                          "openrlhf (OpenRLHF's /get_reward: a reward model with --reward_pretrain, or a rule reward "
                          "with --dataset)")
    args = parser().parse_args(argv)
    problem = check_args(args) or (args.max_length < 0 and "--max_length must not be negative (0: the model's context)")
    if problem:
        return fail(PROG, problem)
    return start("reward", args, load_service, build_app)
