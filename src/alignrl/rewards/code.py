"""The code reward: the program in a response run on the row's test cases (verl's code data sources).

verl scores rows of `codecontests`, `apps`, `codeforces` and `taco` by running the response's code: through a
SandboxFusion service when `reward_model.sandbox_fusion.url` is set, else locally (its prime_code checker), and in
both cases continuously, as the share of the first 10 test cases that pass. The same here, through a `CodeRunner`:
`code_exec.LocalRunner` or `sandbox_client.SandboxClient`.

The ground truth is verl's: a JSON object (or its text) {"inputs": [...], "outputs": [...]}, optionally with
"fn_name". Without it a case is a whole program: the input on stdin, passing when stdout equals the output line by
line, trailing spaces and trailing empty lines aside. With it a case is a call (LeetCode style): the input is the
list of arguments, the function (or the method of class `Solution`) is called on them, and it passes when the result
equals the output (or the output's one element: APPS writes `[answer]`). The code is the last ```python block of the
response, else its first ``` block, else the whole response (verl's rule).
"""

from __future__ import annotations

import functools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from alignrl.config.sandbox_schema import SandboxConfig
from alignrl.rewards.code_exec import CodeRunner, LocalRunner, RunResult

DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco")
FIRST_CASES = 10  # the continuous score is the pass rate of this many cases (verl's)
CALL = """

import json as _alignrl_json, sys as _alignrl_sys
_alignrl_args = _alignrl_json.loads(_alignrl_sys.stdin.read())
_alignrl_fn = getattr(Solution(), {name!r}) if "Solution" in globals() else globals()[{name!r}]
print(_alignrl_json.dumps(_alignrl_fn(*_alignrl_args)))
"""


@dataclass(frozen=True)
class CodeSettings:
    """How each case runs: seconds and MiB per run, and how many runs of one response go at once."""

    timeout_s: float = 10.0
    memory_mb: int = 1024
    max_concurrent: int = 4


@dataclass(frozen=True)
class TestCases:
    inputs: list
    outputs: list
    fn_name: str | None = None


def extract_code(completion: str) -> str:
    """The program of a response, by verl's rule (see the module's note)."""
    if "```python" in completion:
        return completion.split("```python")[-1].split("```")[0]
    if "```" in completion:
        parts = completion.split("```")
        block = parts[1]
        first, newline, rest = block.partition("\n")
        return rest if newline and first.strip().isalpha() else block  # drop a language word (```cpp)
    return completion


def parse_cases(ground_truth: Any) -> TestCases:
    """verl's test cases from a row's ground truth; ValueError saying what is wrong with them."""
    cases = ground_truth
    if isinstance(cases, (str, bytes)):
        try:
            cases = json.loads(cases)
        except ValueError:
            raise ValueError("the ground truth is not JSON; code rows need {\"inputs\": [...], \"outputs\": "
                             "[...]}") from None
    if not isinstance(cases, dict) or not isinstance(cases.get("inputs"), list) \
            or not isinstance(cases.get("outputs"), list):
        raise ValueError("code rows need a ground truth {\"inputs\": [...], \"outputs\": [...]}")
    if len(cases["inputs"]) != len(cases["outputs"]):
        raise ValueError(f"the ground truth has {len(cases['inputs'])} inputs but {len(cases['outputs'])} outputs")
    if not cases["inputs"]:
        raise ValueError("the ground truth has no test cases")
    name = cases.get("fn_name") or None
    if name is not None and (not isinstance(name, str) or not name.isidentifier()):
        raise ValueError(f"the ground truth's fn_name {name!r} is not a Python name")
    return TestCases(cases["inputs"], cases["outputs"], name)


def _text(value: Any) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def case_run(code: str, cases: TestCases, i: int) -> tuple[str, str]:
    """The program and the stdin of case `i`."""
    if cases.fn_name is None:
        return code, _text(cases.inputs[i])
    args = cases.inputs[i]
    if isinstance(args, str):  # some sets store each call's arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            args = [args]
    return code + CALL.format(name=cases.fn_name), json.dumps(args if isinstance(args, list) else [args])


def _lines(text: str) -> list[str]:
    """Output as compared: its lines without trailing spaces, trailing empty lines dropped (judges' outputs often end
    lines with a space; verl's sandbox comparison forgives trailing newlines only, its local checker more)."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def case_passed(result: RunResult, cases: TestCases, i: int) -> bool:
    if not result.succeeded:
        return False
    expected = cases.outputs[i]
    if cases.fn_name is None:
        return _lines(result.stdout) == _lines(_text(expected))
    lines = result.stdout.strip().splitlines()
    try:
        got = json.loads(lines[-1]) if lines else None
    except ValueError:
        return False
    if isinstance(expected, str):
        try:
            expected = json.loads(expected)
        except ValueError:
            pass
    return got == expected or (isinstance(expected, list) and len(expected) == 1 and got == expected[0])


def pass_rate(completion: str, ground_truth: Any, runner: CodeRunner, settings: CodeSettings) -> float:
    """The share of the first FIRST_CASES test cases the response's program passes."""
    cases = parse_cases(ground_truth)
    code = extract_code(completion)
    count = min(FIRST_CASES, len(cases.inputs))

    def one(i: int) -> bool:
        program, stdin = case_run(code, cases, i)
        return case_passed(runner.run(program, stdin, settings.timeout_s, settings.memory_mb), cases, i)

    if count == 1 or settings.max_concurrent <= 1:
        return sum(map(one, range(count))) / count
    with ThreadPoolExecutor(max_workers=min(settings.max_concurrent, count)) as pool:
        return sum(pool.map(one, range(count))) / count


@dataclass(frozen=True)
class CodeReward:
    """The code reward of one run's settings: `reward(solution_str, ground_truth)` as the built-in rules are."""

    runner: CodeRunner
    settings: CodeSettings = CodeSettings()

    def __call__(self, solution_str: str, ground_truth: Any) -> float:
        return pass_rate(solution_str, ground_truth, self.runner, self.settings)


LOCAL = CodeReward(LocalRunner())  # verl without a sandbox URL runs the cases on its own machine too


@functools.lru_cache(maxsize=16)
def code_reward(sandbox: SandboxConfig) -> CodeReward:
    """The code reward of a run's `sandbox` config section (url, max_concurrent, memory_limit_mb, timeout_s): on
    its service, 64 cases at once unless said (verl's), or here, as many at once as this process has cores. Made once
    per section: the reward stage and the held-out scoring share it, and its sandbox client keeps its connections."""
    if sandbox.url:
        from alignrl.rewards.sandbox_client import SandboxClient

        runner, at_once = SandboxClient(sandbox.url), sandbox.max_concurrent or 64
    else:
        runner, at_once = LocalRunner(), sandbox.max_concurrent or len(os.sched_getaffinity(0))
    return CodeReward(runner, CodeSettings(sandbox.timeout_s, sandbox.memory_limit_mb, at_once))
