"""TRL's `--generation_kwargs` (a JSON object handed to vLLM's SamplingParams or transformers' GenerationConfig,
overriding the sampling flags it repeats) as the rollout keys that say the same. alignrl's engines take the settings
they share with both: the others are a one-line error naming them, rather than settings silently dropped.

    alignrl train grpo ... --generation_kwargs '{"stop": ["</answer>"], "min_p": 0.05}'
"""

from __future__ import annotations

import json
from typing import Any

from alignrl.compat.trl_grpo_flags import TrlFlagError
from alignrl.rollout.env_sampling import vllm_setting

# their name -> vLLM's name (env_sampling.FIELDS), for transformers' names of the same settings
SAME_AS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_tokens": "max_tokens", "max_new_tokens": "max_tokens",
           "stop": "stop", "stop_strings": "stop"}


def generation_keys(text: str | None) -> list[str]:
    """The `rollout.*` overrides of a `--generation_kwargs` JSON object (placed after the sampling flags' own, which
    it overrides as TRL's does); [] when the flag is not given."""
    if text is None:
        return []
    try:
        given = json.loads(text)
    except json.JSONDecodeError as e:
        raise TrlFlagError(f"--generation_kwargs {text!r} is not JSON ({e.msg}); give an object such as "
                           "'{\"stop\": [\"</answer>\"], \"min_p\": 0.05}'") from None
    if not isinstance(given, dict):
        raise TrlFlagError(f"--generation_kwargs {text!r} is not a JSON object; give one such as "
                           "'{\"stop\": [\"</answer>\"]}'")
    unknown = sorted(str(k) for k in given if k not in SAME_AS)
    if unknown:
        raise TrlFlagError(f"--generation_kwargs {', '.join(unknown)}: alignrl's engines take only "
                           f"{', '.join(SAME_AS)} there; drop the others")
    return [_rollout_key(name, value) for name, value in given.items()]


def _rollout_key(name: str, value: Any) -> str:
    try:
        field, value_here = vllm_setting(SAME_AS[name], value)
    except ValueError as takes:
        raise TrlFlagError(f"--generation_kwargs {name}={json.dumps(value)}: give {takes}") from None
    if value_here is None:  # max_tokens None: an episode's room left, which means nothing for a whole rollout
        raise TrlFlagError(f"--generation_kwargs {name}=null: give a number of tokens, or leave it to "
                           "--max_completion_length")
    # alignrl's SamplingParams fields are rollout keys of the same names; a list as JSON, which the override's YAML
    # reading takes with its escapes (a stop string of "\n\n")
    if not isinstance(value_here, tuple):
        return f"rollout.{field}={value_here}"
    # unescaped non-ASCII text (a surrogate pair's escape is no YAML), and "${" kept from OmegaConf's interpolation
    return f"rollout.{field}=" + json.dumps([v.replace("${", "\\${") for v in value_here], ensure_ascii=False)
