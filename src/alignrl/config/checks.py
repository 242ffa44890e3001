"""What a config must satisfy beyond its types: ranges and choices from the field metadata, and
combinations of keys that cannot work together. Every failure is one line naming the key and the fix."""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any
from urllib.parse import urlparse

from alignrl.config.agent_checks import multi_turn_problem
from alignrl.config.estimator_checks import UNAVAILABLE, estimator_problem
from alignrl.config.loss_checks import loss_option_problem
from alignrl.config.online_dpo_checks import online_dpo_problem
from alignrl.config.ptx_schema import ptx_problem
from alignrl.config.quantized_checks import quantized_problem
from alignrl.config.ref_checks import needs_reference, ref_path_problem
from alignrl.config.reward_checks import reward_limit_problem
from alignrl.config.rollout_rs import rs_problem
from alignrl.config.schema import CLIP_C_LOSSES, ConfigError, RunConfig


def data_files(value: str | list[str]) -> list[str]:
    """The files a `data.train_files`/`data.val_files` value names: none for 'synthetic', one for a
    path, each of a list (verl's `[a.parquet,b.parquet]`)."""
    if isinstance(value, str):
        return [] if value == "synthetic" else [value]
    return [str(v) for v in value]


def episode_cap(max_turns: int, max_new_tokens: int, max_obs_length: int, max_response_length: int = 0) -> int:
    """Tokens one multi-turn episode's response can hold: the most its turns can produce (max_turns + 1
    turns of max_new_tokens, max_turns observations of max_obs_length), or `max_response_length` when
    that is set and smaller."""
    most = (max_turns + 1) * max_new_tokens + max_turns * max_obs_length
    return min(most, int(max_response_length)) if max_response_length else most


def response_cap(cfg: RunConfig) -> int:
    """The longest response a run produces: rollout.max_new_tokens for single-turn generation, the
    episode's cap for multi-turn tool use, agent.max_response_length (else rollout.max_new_tokens) with an
    environment or verl's tool loop. Length-based shaping and normalisation are relative to it."""
    if cfg.agent.env_path or cfg.agent.tool_config_path or cfg.agent.interaction_config_path:
        return cfg.agent.max_response_length or cfg.rollout.max_new_tokens
    if cfg.agent.max_turns == 0:
        return cfg.rollout.max_new_tokens
    return episode_cap(cfg.agent.max_turns, cfg.rollout.max_new_tokens, cfg.data.max_obs_length,
                       cfg.agent.max_response_length)


def check_ranges(obj: Any, prefix: str = "") -> None:
    for f in dataclasses.fields(obj):
        key, value = f"{prefix}{f.name}", getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            check_ranges(value, key + ".")
            continue
        m = f.metadata
        if m.get("choices") and value not in m["choices"]:
            raise ConfigError(UNAVAILABLE.get((key, value))
                              or f"{key}={value!r} is not allowed; choose one of: {', '.join(map(str, m['choices']))}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} must be a finite number")
        for bound, ok, word in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                                ("le", lambda v, b: v <= b, "<=")):
            if m.get(bound) is not None and value is not None and not ok(value, m[bound]):
                raise ConfigError(f"{key}={value} is out of range; it must be {word} {m[bound]}")


def check_world_size(cfg: RunConfig, world: int) -> None:
    """What a data-parallel run of `world` ranks needs from the batch sizes (checked at launch)."""
    if world <= 1:
        return
    if cfg.trainer.strategy == "single":
        raise ConfigError(f"trainer.strategy=single cannot run on {world} ranks; use ddp, fsdp2 or deepspeed")
    for key, value in (("data.train_batch_size", cfg.data.train_batch_size),
                       ("data.gen_batch_size", cfg.data.gen_batch_size),
                       ("actor.ppo_mini_batch_size", cfg.actor.ppo_mini_batch_size)):
        if value % world:
            raise ConfigError(f"{key}={value} must be a multiple of the world size {world} (each rank takes "
                              "an equal share of every batch)")


def check_combinations(cfg: RunConfig) -> None:
    """Keys that cannot work together: the first problem of `_COMBINATIONS`, in their order, as one line."""
    for check in _COMBINATIONS:
        problem = check(cfg)
        if problem:
            raise ConfigError(problem)


def _batch_sizes(cfg: RunConfig) -> str | None:
    mini = cfg.actor.ppo_mini_batch_size
    by_prompts = cfg.actor.ppo_mini_batch_unit == "prompts"
    step = cfg.data.train_batch_size * (1 if by_prompts else cfg.rollout.n)
    if step < mini:  # as verl asserts; a batch that is no multiple of it ends in a smaller mini-batch, as in verl
        return (f"data.train_batch_size={cfg.data.train_batch_size}" + ("" if by_prompts else
                f" × rollout.n={cfg.rollout.n} sequences") + f" is smaller than one mini-batch, "
                f"actor.ppo_mini_batch_size={mini}: lower it or raise the batch")
    # a micro-batch size that does not divide the mini-batch leaves a smaller last micro-batch: the loss sums over
    # micro-batches with the mini-batch's token count, so the split changes memory, not the update
    return None


def _validation_sampler(cfg: RunConfig) -> str | None:
    r = cfg.rollout
    if r.val_n > 1 and r.val_temperature <= 0:
        return (f"rollout.val_n={r.val_n} answers a problem need sampling: set rollout.val_temperature > 0 "
                "(0 decodes greedily, one answer)")
    return None


def replay_problem(cfg: RunConfig) -> str | None:
    """Replayed groups are off-policy: a replay setting that would train them without the IS correction."""
    p = cfg.pipeline
    if p.replay_buffer_size == 0:
        if p.replay_share > 0:
            return (f"pipeline.replay_share={p.replay_share} needs a replay buffer: set pipeline.replay_buffer_size "
                    "to the groups to keep (or replay_share=0)")
        return None
    why = f"pipeline.replay_buffer_size={p.replay_buffer_size} replays groups sampled by older weights: set "
    if not cfg.actor.recompute_old_logprobs:
        return why + "actor.recompute_old_logprobs=true so that the trainer's log-probs correct them"
    if cfg.algorithm.rollout_is == "none":
        return why + "algorithm.rollout_is=token (or sequence) to correct them by truncated importance sampling"
    return None


def _overlong_buffer(cfg: RunConfig) -> str | None:
    alg = cfg.algorithm
    if alg.overlong_buffer_len > response_cap(cfg):
        single = response_cap(cfg) == cfg.rollout.max_new_tokens
        limit = (f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}" if single else
                 f"the episode's response cap {response_cap(cfg)} (agent.max_response_length)")
        return f"algorithm.overlong_buffer_len={alg.overlong_buffer_len} must be <= {limit}"
    return None


def _rollout_is(cfg: RunConfig) -> str | None:
    alg = cfg.algorithm
    asked = [f"algorithm.{k}={v}" for k, v in (("rollout_is", alg.rollout_is), ("rollout_rs", alg.rollout_rs),
                                                ("rollout_token_veto_threshold", alg.rollout_token_veto_threshold))
             if v not in ("none", None)]
    if asked and not cfg.actor.recompute_old_logprobs:  # the old log-probs would be the rollout's: every ratio 1
        return f"{asked[0]} needs actor.recompute_old_logprobs=true (the trainer's log-probs to compare)"
    if alg.rollout_is_batch_normalize and alg.rollout_is == "none":
        return "algorithm.rollout_is_batch_normalize=true normalises the IS weights: set algorithm.rollout_is=token"
    if rs_problem(alg):
        return rs_problem(alg)
    lower = alg.rollout_is_threshold_lower
    if alg.rollout_is_mode == "truncate" and lower is not None and lower >= alg.rollout_is_threshold:
        return (f"algorithm.rollout_is_threshold_lower={lower} must be below algorithm.rollout_is_threshold="
                f"{alg.rollout_is_threshold}: truncation clamps the weights into [lower, threshold]")
    if alg.rollout_is_mode == "geo_mask" and alg.rollout_is == "sequence":
        return ("algorithm.rollout_is_mode=geo_mask weights each token by its own ratio: set algorithm.rollout_is="
                "token (the sequence's geometric mean decides only whether it stays)")
    low = lower if lower is not None else 1.0 / alg.rollout_is_threshold
    if alg.rollout_is_mode != "truncate" and (low > alg.rollout_is_threshold if alg.rollout_is_mode == "zero" else
                                              low >= alg.rollout_is_threshold):
        return (f"algorithm.rollout_is_threshold_lower={lower if lower is not None else 'default 1/threshold'}"
                f" must be below algorithm.rollout_is_threshold={alg.rollout_is_threshold}, or every token "
                "is rejected: raise the threshold above 1 or set a lower bound below it")
    return None


def _loggers_and_files(cfg: RunConfig) -> str | None:
    unknown = set(cfg.trainer.logger) - {"console", "jsonl", "tensorboard", "wandb"}
    if unknown:
        verl = " (verl's file logger is alignrl's jsonl: metrics.jsonl)" if "file" in unknown else ""
        return (f"trainer.logger has unknown sink(s) {sorted(unknown)}; allowed: console, jsonl, "
                f"tensorboard, wandb{verl}")
    for key in ("train_files", "val_files"):
        files = getattr(cfg.data, key)
        if not (isinstance(files, str) or (isinstance(files, list) and files
                                           and all(isinstance(f, str) for f in files))):
            return (f"data.{key}={files!r} must be a file path or a list of them "
                    "(e.g. data.train_files=[a.parquet,b.parquet])")
    return None


def _train_probs(cfg: RunConfig) -> str | None:
    """data.train_files_probs: one positive finite weight per file (a zero weight would never use its file, so the
    blend, which ends once every file was used, would never end)."""
    probs, files = cfg.data.train_files_probs, data_files(cfg.data.train_files)
    if not probs:
        return None
    if not isinstance(probs, list) or len(probs) != len(files):
        count = len(probs) if isinstance(probs, list) else 1
        return (f"data.train_files_probs={probs!r} has {count} weight(s) for {len(files)} data.train_files: give "
                "one per file, e.g. [0.7,0.3] for two, or [] to concatenate them")
    bad = next((p for p in probs if not (_number(p) and math.isfinite(p) and p > 0)), None)
    if bad is not None:
        return (f"data.train_files_probs={probs!r}: {bad!r} is not a finite number above 0; give each file a "
                "positive weight, e.g. [0.7,0.3]")
    return None


def _optimiser_and_clips(cfg: RunConfig) -> str | None:
    for key, b in (("actor.betas", cfg.actor.betas), ("critic.betas", cfg.critic.betas)):
        if not (isinstance(b, list) and len(b) == 2 and all(_number(x) and 0 <= x < 1 for x in b)):
            return f"{key}={b!r} must be two numbers in [0, 1), e.g. [0.9,0.999]"
    clip = cfg.algorithm.reward_clip
    if clip and not (isinstance(clip, list) and len(clip) == 2 and all(map(_number, clip)) and clip[0] < clip[1]):
        return (f"algorithm.reward_clip={clip!r} must be [low, high] with low < high (e.g. [-10,10]), or [] "
                "for none")
    if 0 < cfg.actor.clip_ratio_c <= 1:
        return (f"actor.clip_ratio_c={cfg.actor.clip_ratio_c} must be > 1 (the dual clip, or DPPO's truncation of the "
                "ratio), or 0 (no dual clip; DPPO: 20)")
    if cfg.actor.clip_ratio_c and cfg.actor.policy_loss not in CLIP_C_LOSSES:
        return ("actor.clip_ratio_c (dual-clip, or DPPO's truncation of the ratio) applies to actor.policy_loss="
                f"{', '.join(CLIP_C_LOSSES)} only")
    if cfg.actor.clip_cov_lb >= cfg.actor.clip_cov_ub:
        return (f"actor.clip_cov_lb={cfg.actor.clip_cov_lb} must be below actor.clip_cov_ub={cfg.actor.clip_cov_ub}: "
                "clip_cov draws its tokens among those whose covariance lies between them")
    return None


def _critic(cfg: RunConfig) -> str | None:
    gae = cfg.algorithm.adv_estimator == "gae"
    if gae and not cfg.critic.enable:
        return ("algorithm.adv_estimator=gae needs a critic: set critic.enable=true "
                "(or pick a critic-free estimator: grpo, rloo, reinforce_plus_plus)")
    if cfg.critic.enable and not gae:
        return (f"critic.enable=true is only used by algorithm.adv_estimator=gae "
                f"(got {cfg.algorithm.adv_estimator}); set critic.enable=false or use gae")
    return None


def _pipeline(cfg: RunConfig) -> str | None:
    if cfg.pipeline.placement == "zmq" and (cfg.algorithm.dynamic_sampling or cfg.services.generation_url):
        return ("pipeline.placement=zmq: samplers generate, so algorithm.dynamic_sampling and "
                "services.generation_url do not apply; drop them or use pipeline.placement=inline")
    if cfg.actor.gradient_checkpointing and cfg.actor.share_prompt:  # transformers keeps no cache under it
        return ("actor.gradient_checkpointing does not combine with actor.share_prompt (the shared prompt's "
                "keys/values are a cache, which checkpointed layers do not return): drop one of them")
    if cfg.pipeline.placement == "zmq" and cfg.pipeline.data_port == cfg.pipeline.sync_port:
        return (f"pipeline.data_port and pipeline.sync_port are both {cfg.pipeline.data_port}: the "
                "trainer binds one socket on each, so give them different ports (defaults: 5555 and 5556)")
    return None


def _ref_sync(cfg: RunConfig) -> str | None:
    """actor.ref_sync_steps moves a frozen reference copy held in the trainer's own processes (placements.ref_sync);
    actor.ema_beta averages every weight of the policy (train.ema)."""
    if cfg.actor.ema_beta and cfg.model.lora_rank > 0:  # its average would be of the frozen base and the adapters
        return ("actor.ema_beta averages all the policy's weights, and with model.lora_rank > 0 only its adapters "
                "train: set one of them")
    if not cfg.actor.ref_sync_steps or cfg.model.ref_path:  # with a reference of its own: ref_checks says why
        return None
    key = f"actor.ref_sync_steps={cfg.actor.ref_sync_steps}"
    if not needs_reference(cfg):
        return (f"{key} moves the reference, which this run never reads (no KL term): add one (actor.use_kl_loss "
                "with actor.kl_loss_coef > 0, or algorithm.use_kl_in_reward) or set actor.ref_sync_steps=0")
    where = ("model.lora_rank > 0 makes the reference the policy with its adapters off, with no weights of its "
             "own" if cfg.model.lora_rank > 0 else
             "services.reference_url computes the reference's log-probs in a service with weights of its own"
             if cfg.services.reference_url else
             "pipeline.placement=zmq computes the reference's log-probs in the samplers"
             if cfg.pipeline.placement == "zmq" else "")
    return f"{key} cannot move the reference: {where}; set actor.ref_sync_steps=0" if where else None


def _safety(cfg: RunConfig) -> str | None:
    if cfg.safety.cost_fn and cfg.safety.cost_model:
        return "set one of safety.cost_fn (a rule) or safety.cost_model (a model), not both"
    if (cfg.safety.cost_fn or cfg.safety.cost_model) and cfg.algorithm.adv_estimator != "gae":
        return ("safety.cost_fn / safety.cost_model (PPO-Lagrangian) needs a cost critic: set "
                "algorithm.adv_estimator=gae and critic.enable=true")
    return None


def _urls(cfg: RunConfig) -> str | None:
    problem = retriever_url_problem(cfg.retriever.url)
    a = cfg.agent
    if a.max_turns and a.search and not (a.env_path or a.tool_config_path or a.interaction_config_path) and problem:
        return problem
    for kind in ("generation", "reference", "reward"):  # here, once, not on every rank as it connects
        value = getattr(cfg.services, f"{kind}_url")
        # several reward services share a batch (comma-separated): each must be an address
        for url in reward_urls(value) if kind == "reward" else [value] * bool(value):
            problem = url_problem(f"services.{kind}_url={url!r} (the seed layout's training.services.{kind}.url)",
                                  url, f"give the {kind} service's address, e.g. http://127.0.0.1:8000")
            if problem:
                return problem
    return None


def reward_urls(value: str) -> list[str]:
    """The reward service URLs of a services.reward_url value: one URL, or several separated by commas."""
    return [part.strip() for part in value.split(",") if part.strip()]


def url_problem(named: str, url: str, fix: str) -> str | None:
    """Why `url` (`named` so in the line) is not an http(s) URL, with `fix`, or None."""
    parts = urlparse(url)
    return None if parts.scheme in ("http", "https") and parts.netloc else f"{named} is not an http(s) URL: {fix}"


def retriever_url_problem(url: str, key: str = "retriever.url") -> str | None:
    """What is wrong with a retrieval endpoint's URL, or None (the config's check and the client's)."""
    return url_problem(f"{key}={url!r}", url, f"give the retrieval server's endpoint, e.g. "
                       f"{key}=http://127.0.0.1:8000/retrieve")


def check_prompt_keys(cfg: RunConfig) -> None:
    """The prompt-column keys (OpenRLHF's --input_key/--label_key/--input_template/--apply_chat_template)
    only mean something together: a template needs its {} slot and untemplated prompts."""
    d = cfg.data
    if d.prompt_key is None:
        templated = "the GSM8K/verl layouts and synthetic data are always chat-templated"
        for key, value, default, why in (
                ("label_key", d.label_key, None, "the GSM8K/verl layouts and synthetic data carry their answers"),
                ("input_template", d.input_template, None, templated),
                ("apply_chat_template", d.apply_chat_template, True, templated)):
            if value != default:
                raise ConfigError(f"data.{key} applies to files read by column: set data.prompt_key=<prompt column> "
                                  f"({why})")
        return
    if d.format != "auto":
        raise ConfigError(f"data.format={d.format} and data.prompt_key name the layout twice; drop data.format "
                          "(data.prompt_key reads the prompt from that column)")
    if d.input_template is not None:
        if "{}" not in d.input_template:
            raise ConfigError(f"data.input_template={d.input_template!r} has no {{}} where the prompt goes "
                              "(e.g. data.input_template='User: {}\\nAssistant: ')")
        try:
            d.input_template.format("")
        except (IndexError, KeyError, ValueError):
            raise ConfigError(f"data.input_template={d.input_template!r} has braces other than one {{}}; write a "
                              "literal brace as {{ or }}") from None
        if d.apply_chat_template:
            raise ConfigError("data.input_template is used only with data.apply_chat_template=false (with the chat "
                              "template, OpenRLHF ignores --input_template); set one of them")
    if not d.apply_chat_template and d.system_prompt is not None:
        raise ConfigError("data.system_prompt is a chat message: it needs data.apply_chat_template=true (or put the "
                          "text into data.input_template)")


def _dynamic_sampling(cfg: RunConfig) -> str | None:
    band = cfg.algorithm.dynamic_sampling_range
    if band and not (isinstance(band, list) and len(band) == 2 and all(map(_number, band)) and band[0] < band[1]):
        return (f"algorithm.dynamic_sampling_range={band!r} must be [low, high] with low < high (e.g. [0,1]), or [] "
                "to keep the groups whose rewards differ")
    if band and not cfg.algorithm.dynamic_sampling:  # a filter that never runs: the user expects it to
        return (f"algorithm.dynamic_sampling_range={band!r} is read only with algorithm.dynamic_sampling=true; "
                "set it, or leave the range out")
    gen = cfg.data.gen_batch_size
    if gen and gen != cfg.data.train_batch_size and not cfg.algorithm.dynamic_sampling:
        return (f"data.gen_batch_size={gen} is read only with algorithm.dynamic_sampling=true (without it every "
                "prompt drawn is trained): set data.train_batch_size instead, or turn dynamic sampling on")
    return None


# check_combinations' checks, in the order they run: each returns its one-line problem or None
# (check_prompt_keys raises its own, with the same kind of line)
_COMBINATIONS = (_batch_sizes, online_dpo_problem, _validation_sampler, replay_problem, _overlong_buffer,
                 _rollout_is, _loggers_and_files, check_prompt_keys, _train_probs, _optimiser_and_clips,
                 _dynamic_sampling, estimator_problem, _critic, _pipeline, _ref_sync, _safety, _urls, multi_turn_problem,
                 ptx_problem, reward_limit_problem, loss_option_problem, ref_path_problem, quantized_problem)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def did_you_mean(key: str, names: list[str]) -> str:
    """` (did you mean 'section.name'?)` for the one or two known names closest to the last part of `key`, or
    ""."""
    parent, _, last = key.rpartition(".")
    close = [f"'{parent + '.' if parent else ''}{name}'" for name in difflib.get_close_matches(last, names, n=2,
                                                                                                cutoff=0.6)]
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def nearest_sibling(key: str, keys) -> str:
    """did_you_mean among those of the dotted `keys` that share `key`'s parent."""
    parent = key.rpartition(".")[0]
    return did_you_mean(key, [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent])
