"""OpenRLHF's reward file: a Python file defining `reward_func(queries, prompts, labels)` (its `--remote_rm_url
path/to/file.py`), called as alignrl's per-row reward.

OpenRLHF calls it with lists (current versions: one sample per call) of query texts (the prompt text followed by the
response), prompt texts and labels, and takes back a tensor of rewards or a dict whose "rewards" are them (beside
"scores", used by its dynamic filtering, and "extra_logs", logged). Here the prompt is the text the policy read
(its chat template's special tokens kept, the padding not), passed by the reward stage and the held-out evaluation
(`registry.score_row`), and the query that prompt followed by the decoded response. "scores" ride with the reward
(`values.RowScore`) for dynamic filtering, as OpenRLHF's filter tests them; "extra_logs" are not used.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from pathlib import Path
from typing import Any

SPEC_PREFIX = "openrlhf:"  # algorithm.reward_fn=openrlhf:PATH names OpenRLHF's reward_func in PATH
FUNCTION = "reward_func"


def is_openrlhf_spec(spec: str | None) -> bool:
    return bool(spec) and spec.startswith(SPEC_PREFIX)


def adapt(reward_func: Callable[..., Any], who: str) -> Callable[..., Any]:
    """OpenRLHF's batch `reward_func` as a verl-signature function of one row (its one-line errors are the registry's
    `checked`, which wraps this)."""
    from alignrl.rewards.errors import ScoreError

    def call(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
             prompt: str | None = None) -> Any:
        label = ground_truth if ground_truth is None or isinstance(ground_truth, str) else str(ground_truth)
        got = reward_func([(prompt or "") + solution_str], [prompt or ""], [label])
        if not isinstance(got, dict):
            return one_value(got, who, data_source)
        if "rewards" not in got:
            raise ScoreError(who, f"returned a dict without 'rewards' (keys {sorted(map(str, got))[:5]})",
                             data_source, "return a tensor of rewards or {'rewards': tensor, ...} as OpenRLHF's "
                             "reward_func does")
        reward = one_value(got["rewards"], who, data_source)
        if got.get("scores") is None:
            return reward
        # "scores" are what OpenRLHF's dynamic filtering tests; both are checked finite by the registry's wrapper
        return {"score": reward, "filter_score": one_value(got["scores"], who, data_source)}

    call.reads_prompt = True  # the callers pass the prompt's text: the query is the prompt followed by the response
    return call


def one_value(got: Any, who: str, data_source: str) -> Any:
    """The single reward of a one-row call: a number, or a tensor, array or list of one element."""
    from alignrl.rewards.errors import ScoreError

    if isinstance(got, numbers.Real) or got is None or isinstance(got, str):
        return got  # the registry's finite check names what is wrong with a None or a string
    values = got.tolist() if hasattr(got, "tolist") else list(got) if isinstance(got, (list, tuple)) else None
    if isinstance(values, numbers.Real):  # a 0-d tensor or array
        return values
    if not isinstance(values, list) or len(values) != 1:
        shown = f"{len(values)} values" if isinstance(values, list) else f"a {type(got).__name__}"
        raise ScoreError(who, f"returned {shown} for one query", data_source,
                         "return one reward per query (a tensor of len(queries) rewards)")
    return values[0]


def load(path_str: str, key: str, import_file: Callable[[Path, str], Any]) -> Callable[..., Any]:
    """The adapted reward_func of the file at `path_str`; `import_file(path, key)` (the registry's) imports it with
    its one-line errors. `key` names the setting in the errors."""
    from alignrl.rewards.errors import RewardError

    path = Path(path_str)
    if not path.is_file():
        raise RewardError(f"{key} file not found: {path_str} (give the Python file that defines "
                          f"{FUNCTION}(queries, prompts, labels))")
    module = import_file(path, key)
    fn = getattr(module, FUNCTION, None)
    if not callable(fn):
        raise RewardError(f"{key} file {path_str} defines no function {FUNCTION}(queries, prompts, labels), which "
                          "OpenRLHF's reward files define")
    return adapt(fn, f"{path_str}:{FUNCTION}")
