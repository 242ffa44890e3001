"""Where an OpenRLHF `train_ppo_ray` run's prompts and rewards come from: `--prompt_data` (one file, or several
separated by commas, which OpenRLHF blends) and `--remote_rm_url` (a reward service URL, or a Python file defining
OpenRLHF's `reward_func(queries, prompts, labels)`), checked and said as alignrl config keys."""

from __future__ import annotations

import json
from pathlib import Path

from alignrl.config import ConfigError
from alignrl.rewards.openrlhf_reward import SPEC_PREFIX


class SourceFlagError(ConfigError):
    """A --prompt_data or --remote_rm_url value alignrl cannot read; one line naming it and the fix."""


def split_files(value: str | None) -> list[str]:
    """OpenRLHF's comma-separated dataset list, as its blend_datasets splits it."""
    return [] if not value else [part.strip() for part in value.split(",") if part.strip()]


def files_value(value: str) -> str:
    """A data-files config value: the file itself, or a JSON list of the comma-separated files (alignrl's loader
    concatenates a list)."""
    files = split_files(value)
    return files[0] if len(files) == 1 else json.dumps(files)


def reward_file(args) -> Path | None:
    """The Python reward file --remote_rm_url names, or None for a service URL (or no --remote_rm_url)."""
    url = args.remote_rm_url
    return Path(url) if url and url.strip().endswith(".py") and "," not in url else None


def check_sources(args) -> None:
    """--remote_rm_url: one service URL or one existing .py file; --prompt_data_probs: one probability per file."""
    url = args.remote_rm_url
    if url and "," in url:
        raise SourceFlagError(f"--remote_rm_url {url}: alignrl takes one reward service URL or one .py reward file; "
                              "its reward client talks to a single service (OpenRLHF shards each batch over the "
                              "comma-separated URLs): put the services behind one URL, or give one of them")
    path = reward_file(args)
    if path is not None and not path.is_file():
        raise SourceFlagError(f"--remote_rm_url {url}: no such file (from {Path.cwd()}); give the Python file that "
                              "defines reward_func(queries, prompts, labels), or a reward service URL")
    files = split_files(args.prompt_data)
    probs = split_files(args.prompt_data_probs)
    if len(files) > 1 and probs not in ([], ["1.0"]) and len(probs) != len(files):
        raise SourceFlagError(f"--prompt_data_probs {args.prompt_data_probs}: {len(probs)} probabilities for "
                              f"{len(files)} --prompt_data files; give one per file")


def equal_probs(args) -> bool:
    """--prompt_data_probs asks for no weighting: absent, OpenRLHF's '1.0', or the same number for every file."""
    probs = split_files(args.prompt_data_probs)
    try:
        return len({float(p) for p in probs}) <= 1
    except ValueError:
        raise SourceFlagError(f"--prompt_data_probs {args.prompt_data_probs}: give numbers separated by commas") \
            from None


def reward_keys(args) -> list[str]:
    """--remote_rm_url as alignrl's reward: a .py file's reward_func as algorithm.reward_fn (OpenRLHF's signature,
    adapted by alignrl.rewards.openrlhf_reward), a URL as services.reward_url."""
    path = reward_file(args)
    if path is not None:
        return [f"algorithm.reward_fn={json.dumps(SPEC_PREFIX + str(path.absolute()))}"]
    return [f"services.reward_url={args.remote_rm_url}"] if args.remote_rm_url else []
