"""Where an OpenRLHF `train_ppo_ray` run's prompts and rewards come from: `--prompt_data` (one file, or several
separated by commas, blended by `--prompt_data_probs`) and `--remote_rm_url` (reward service URLs, or a Python file
defining OpenRLHF's `reward_func(queries, prompts, labels)`), checked and said as alignrl config keys."""

from __future__ import annotations

import json
import math
from pathlib import Path

from alignrl.config import ConfigError
from alignrl.data.sources import is_library_dataset, with_split
from alignrl.rewards.openrlhf_reward import SPEC_PREFIX

OPENRLHF_INPUT_KEY = "input"  # OpenRLHF's --input_key default


class SourceFlagError(ConfigError):
    """A --prompt_data or --remote_rm_url value alignrl cannot read; one line naming it and the fix."""


def split_files(value: str | None) -> list[str]:
    """OpenRLHF's comma-separated dataset list, as its blend_datasets splits it."""
    return [] if not value else [part.strip() for part in value.split(",") if part.strip()]


def files_value(value: str, split: str | None = None) -> str:
    """A data-files config value: the file itself, or a JSON list of the comma-separated files (alignrl's loader
    concatenates a list, or blends it by data.train_files_probs); `split`: the split each dataset folder or Hub
    dataset reads (a .jsonl/.json/.parquet file is read whole)."""
    files = [with_split(f, split) if split and value != "synthetic" else f for f in split_files(value)]
    return files[0] if len(files) == 1 else json.dumps(files)


def prompt_split(args) -> str | None:
    """--prompt_split where it is not the split a training setting reads unasked (train)."""
    return None if args.prompt_split == "train" else args.prompt_split


def val_value(args) -> str:
    """data.val_files: --eval_dataset's --eval_split (OpenRLHF's default: train), else the training prompts."""
    if args.eval_dataset:
        return files_value(args.eval_dataset, args.eval_split)
    return files_value(args.prompt_data, args.prompt_split)


def unsplit_flags(args) -> list[str]:
    """The split flags given whose datasets are all files, read whole: they change nothing."""
    named = (("prompt_split", args.prompt_data), ("eval_split", args.eval_dataset))
    return [flag for flag, value in named if value and value != "synthetic" and getattr(args, flag) != "train"
            and not any(is_library_dataset(f) for f in split_files(value))]


def reward_file(args) -> Path | None:
    """The Python reward file --remote_rm_url names, or None for service URLs (or no --remote_rm_url)."""
    parts = split_files(args.remote_rm_url)
    return Path(parts[0]) if len(parts) == 1 and parts[0].endswith(".py") else None


def check_sources(args) -> None:
    """--remote_rm_url: service URLs (comma-separated: each batch is sharded over them) or one existing .py file;
    --prompt_data_probs: one positive weight per --prompt_data file."""
    url, parts = args.remote_rm_url, split_files(args.remote_rm_url)
    if len(parts) > 1 and any(part.endswith(".py") for part in parts):
        raise SourceFlagError(f"--remote_rm_url {url}: give one .py reward file, or reward service URLs separated "
                              "by commas; several reward files (or files beside URLs) are not combined")
    bad = next((part for part in parts if len(parts) > 1 and not part.startswith(("http://", "https://"))), None)
    if bad is not None:
        raise SourceFlagError(f"--remote_rm_url {url}: {bad!r} is not a reward service URL; give each of the "
                              "comma-separated services as http://host:port[/path]")
    path = reward_file(args)
    if path is not None and not path.is_file():
        raise SourceFlagError(f"--remote_rm_url {url}: no such file (from {Path.cwd()}); give the Python file that "
                              "defines reward_func(queries, prompts, labels), or a reward service URL")
    weights(args)


def weights(args) -> list[float]:
    """--prompt_data_probs as numbers (`flag_weights`), one per --prompt_data file, as OpenRLHF's blending_datasets
    asserts."""
    files, probs = split_files(args.prompt_data), flag_weights(args.prompt_data_probs, "--prompt_data_probs",
                                                               "--prompt_data")
    if probs and len(probs) != len(files):
        raise SourceFlagError(f"--prompt_data_probs {args.prompt_data_probs}: {len(probs)} probabilities for "
                              f"{len(files)} --prompt_data files; give one per file")
    return probs


def flag_weights(value: str | None, flag: str, files_flag: str) -> list[float]:
    """A weights flag (`flag`, over the files of `files_flag`) as numbers ([] when absent or OpenRLHF's old default
    '1.0', which weights nothing), each finite and above 0: a zero weight never draws its file, and the blend ends
    only once every file was used."""
    probs = split_files(value)
    if probs in ([], ["1.0"]):
        return []
    try:
        out = [float(p) for p in probs]
    except ValueError:
        raise SourceFlagError(f"{flag} {value}: give numbers separated by commas, one per {files_flag} file "
                              "(e.g. 0.7,0.3)") from None
    if not all(math.isfinite(p) and p > 0 for p in out):
        raise SourceFlagError(f"{flag} {value}: each probability must be a finite number above 0 (e.g. 0.7,0.3); "
                              f"leave a file out of {files_flag} to not use it")
    return out


def probs_keys(args) -> list[str]:
    """--prompt_data_probs over several files as data.train_files_probs: the files blended as OpenRLHF's
    interleave_datasets blends them (equal weights too: OpenRLHF interleaves them rather than concatenating).
    One file is read as it is, whatever its weight."""
    probs = weights(args)
    return [f"data.train_files_probs={json.dumps(probs)}"] if probs and len(split_files(args.prompt_data)) > 1 \
        else []


def prompt_rows(args) -> int:
    """The prompts a --prompt_data run trains on, counted without reading them, as OpenRLHF has them: each file's
    first --max_samples rows, concatenated or blended by --prompt_data_probs (a blend repeats rows), then the first
    --max_samples of those; --max_samples problems of the synthetic task. (OpenRLHF's --num_episodes counts its steps
    from this, and its dynamic filtering refills until they run out.)"""
    from alignrl.data.blend import blend_order
    from alignrl.data.loaders import count_rows

    if args.prompt_data == "synthetic":
        return args.max_samples

    files = [with_split(f, args.prompt_split) for f in split_files(args.prompt_data)]
    rows = [min(args.max_samples, count_rows(f, key="--prompt_data")) for f in files]
    blended = len(blend_order(rows, weights(args), args.seed)) if probs_keys(args) else sum(rows)
    return min(args.max_samples, blended)


def reward_keys(args) -> list[str]:
    """--remote_rm_url as alignrl's reward: a .py file's reward_func as algorithm.reward_fn (OpenRLHF's signature,
    adapted by alignrl.rewards.openrlhf_reward), URLs as services.reward_url (comma-separated, as given)."""
    path = reward_file(args)
    if path is not None:
        return [f"algorithm.reward_fn={json.dumps(SPEC_PREFIX + str(path.absolute()))}"]
    urls = split_files(args.remote_rm_url)
    return [f"services.reward_url={','.join(urls)}"] if urls else []


def ptx_keys(args) -> list[str]:
    """--pretrain_data (PPO-ptx) as the ptx.* keys: its files, their weights (--pretrain_data_probs, over several
    files), the text column (OpenRLHF reads its --input_key, 'input' by default), --ptx_coef, and --max_len, which
    caps a text where given (OpenRLHF: else --prompt_max_len + --generate_max_len, ptx.max_length's 0)."""
    if not args.pretrain_data:
        return []
    out = [f"ptx.data={files_value(args.pretrain_data)}", f"ptx.coef={args.ptx_coef}",
           f"ptx.key={json.dumps(args.input_key or OPENRLHF_INPUT_KEY)}"]
    probs = flag_weights(args.pretrain_data_probs, "--pretrain_data_probs", "--pretrain_data")
    if len(split_files(args.pretrain_data)) > 1 and probs:
        out.append(f"ptx.data_probs={json.dumps(probs)}")
    if args.max_len:
        out.append(f"ptx.max_length={args.max_len}")
    return out
