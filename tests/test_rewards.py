"""Reward functions: GSM8K extraction, math-verify equivalence, the registry and custom files."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from alignrl.rewards import gsm8k, math_dapo
from alignrl.rewards import math as math_reward
from alignrl.rewards.registry import (
    REWARDS,
    RewardError,
    default_compute_score,
    load_reward_fn,
    make_reward,
)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("5", "5"), ("5.0", "5"), ("3.50", "3.5"), ("1,234", "1234"), ("$5", "5"), ("-$1,000.00", "-1000"),
     ("$-2", "-2"), ("-0", "0"), (".25", "0.25"), ("+7", "7"), (" 12 ", "12"), ("abc", "abc"),
     ("1" * 4301, "1" * 4301)],  # past Python's int-to-text digit limit: kept as text, not a ValueError
)
def test_normalize_number(raw: str, expected: str) -> None:
    assert gsm8k.normalize_number(raw) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so 3 + 4 = 7\n#### 7", "7"),
        ("#### 1,234", "1234"),
        ("#### $5", "5"),
        ("#### -12", "-12"),
        ("#### 3.50", "3.5"),
        ("#### 2\nwait, recheck\n#### 3", "3"),  # last match wins
        ("####42.", "42"),
        ("the answer is 7", None),
        ("#### seven", None),
    ],
)
def test_extract_strict(text: str, expected: str | None) -> None:
    assert gsm8k.extract_strict(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3 apples and 4 pears make 7 fruit.", "7"),
        ("It costs $1,250.50 in total", "1250.5"),
        ("temperature fell to -4 degrees", "-4"),
        ("#### 9\nthat is all", "9"),
        ("no digits here", None),
    ],
)
def test_extract_flexible(text: str, expected: str | None) -> None:
    assert gsm8k.extract_flexible(text) == expected


def test_strict_and_flexible_differ() -> None:
    text = "3 + 4 = 7, so the answer is 7"
    assert gsm8k.extract_strict(text) is None
    assert gsm8k.extract_flexible(text) == "7"
    assert gsm8k.compute_score(text, "7") == 0.0
    assert gsm8k.compute_score(text, "7", method="flexible") == 1.0
    assert gsm8k.extract_flexible("#### 7\nchecking: 7 - 2 = 5") == "5"
    assert gsm8k.extract_strict("#### 7\nchecking: 7 - 2 = 5") == "7"


def test_gsm8k_compute_score_semantics() -> None:
    assert gsm8k.compute_score("... #### 1,234", "1234") == 1.0
    assert gsm8k.compute_score("... #### 1234.00", "1,234") == 1.0
    assert gsm8k.compute_score("... #### 72", "72", score=2.0) == 2.0
    assert gsm8k.compute_score("... #### 71", "72", format_score=0.1) == 0.1
    assert gsm8k.compute_score("no answer", "72", format_score=0.1) == 0.0
    with pytest.raises(ValueError, match="unknown gsm8k extraction method 'fuzzy'"):
        gsm8k.compute_score("#### 1", "1", method="fuzzy")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("reasoning\n#### 72", 1.0),
        ("reasoning\n#### -1,234.5  \n\n", 1.0),
        ("#### 72", 1.0),
        ("reasoning\n#### 72 apples", 0.0),
        ("reasoning #### 72", 0.0),  # not on its own line
        ("#### 72\nmore text after", 0.0),
        ("the answer is 72", 0.0),
    ],
)
def test_format_reward(text: str, expected: float) -> None:
    assert gsm8k.format_reward(text) == expected


@pytest.mark.parametrize(
    ("solution", "truth", "expected"),
    [
        ("The answer is 1/2", "0.5", 1.0),
        ("The answer is 0.5", "\\frac{1}{2}", 1.0),
        ("so we get \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("so we get \\boxed{\\frac{1}{2}}", "1/2", 1.0),
        ("\\boxed{2^{1/2}}", "\\sqrt{2}", 1.0),
        ("\\boxed{1+x}", "x+1", 1.0),
        ("first \\boxed{3}, no: \\boxed{\\frac{8}{2}}", "4", 1.0),  # last box wins
        ("\\boxed{7} and later the number 72", "72", 0.0),  # boxed beats a later number
        ("steps...\n#### 0.5", "\\frac{1}{2}", 1.0),
        ("the total is 72", "72", 1.0),
        ("\\boxed{\\frac{1}{3}}", "1/2", 0.0),
        ("I don't know", "1/2", 0.0),
        ("\\boxed{18.90}", "\\$18.90", 1.0),  # an escaped dollar in the reference is a price, not math mode
        ("\\boxed{\\$18.90}", "\\$18.90", 1.0),
        ("\\boxed{9^{9^{9}}}", "5", 0.0),  # an exponent tower: compared as text, never evaluated
        ("\\boxed{10^{10^{10}}}", "10^{10^{10}}", 1.0),
        ("\\boxed{2^{10}}", "1024", 1.0),
    ],
)
def test_math_compute_score(solution: str, truth: str, expected: float) -> None:
    assert math_reward.compute_score(solution, truth) == expected


def test_math_last_boxed_balances_braces() -> None:
    assert math_reward.last_boxed("x \\boxed{\\frac{1}{2}} y") == "\\frac{1}{2}"
    assert math_reward.last_boxed("\\boxed{1} \\fbox{ {2} }") == "{2}"
    assert math_reward.last_boxed("\\boxed{unclosed") is None


def test_math_score_works_off_the_main_thread() -> None:
    # math_verify's default SIGALRM timeout raises in worker threads; scoring must still work.
    with ThreadPoolExecutor(max_workers=4) as pool:
        scores = list(pool.map(lambda s: math_reward.compute_score(s, "0.5"), ["\\boxed{1/2}", "0.25"] * 4))
    assert scores == [1.0, 0.0] * 4


def test_math_scoring_says_nothing_about_its_timeouts_being_off() -> None:
    """math_verify logs once per process that its timeouts are off; every Ray worker and sampler printed that line.
    A fresh process, as a worker is: the score on stdout, nothing on stderr."""
    import os
    import subprocess
    import sys

    from conftest import src_path

    code = "from alignrl.rewards.math import compute_score as c; print(c('so \\\\boxed{1/2}', '0.5'), c('#### 3', '4'))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": src_path()})
    assert p.returncode == 0 and p.stdout.split() == ["1.0", "0.0"] and p.stderr == "", p.stderr


def test_registry_routes_by_data_source() -> None:
    assert REWARDS["openai/gsm8k"] is gsm8k.compute_score
    assert REWARDS["synthetic_arith"] is gsm8k.compute_score
    # math_dapo rows are scored as verl scores them, by DAPO's "Answer:" rule with a reward of +1/-1 (they were
    # math-verify's 1/0 before): tests/test_math_dapo.py holds that rule's cases.
    assert REWARDS["math_dapo"] is math_dapo.compute_score
    assert REWARDS["lighteval/MATH"] is math_reward.compute_score
    # 1/2 is only equal to 0.5 under the math rule; gsm8k's strict rule needs "#### 0.5".
    assert default_compute_score("lighteval/MATH", "\\boxed{1/2}", "0.5") == 1.0
    assert default_compute_score("gsm8k", "\\boxed{1/2}", "0.5") == 0.0
    assert default_compute_score("gsm8k", "#### 0.50", "0.5", {"split": "test"}) == 1.0


def test_registry_unknown_source() -> None:
    with pytest.raises(RewardError) as excinfo:
        default_compute_score("my/dataset", "#### 1", "1")
    message = str(excinfo.value)
    assert "\n" not in message
    assert message.startswith("no built-in reward for data_source 'my/dataset' (known: ")
    assert "DigitalLearningGmbH/MATH-lighteval, apps, bamboogle, codecontests, codeforces, gsm8k, " in message
    assert message.endswith("for other data pass algorithm.reward_fn=path/to/file.py:function)")


def test_load_reward_fn_default() -> None:
    assert load_reward_fn(None) is default_compute_score


def test_the_zero_reward_is_built_in() -> None:
    """algorithm.reward_fn=zero: no task reward, for any data_source (on-policy distillation's recipe needs no file)."""
    fn = load_reward_fn("zero")
    assert fn("no-such-source", "#### 3", "3") == 0.0 and fn("gsm8k", "#### 3", "3", {"k": 1}) == 0.0
    assert make_reward("zero", format_weight=0.5)("gsm8k", "#### 3", "3") == 0.5  # shaping still adds on top
    with pytest.raises(RewardError, match="reward_fn_batch"):
        load_reward_fn("zero", batched=True)


def test_load_custom_reward_fn(tmp_path: Path) -> None:
    path = tmp_path / "my_reward.py"
    path.write_text(
        "from dataclasses import dataclass\n"
        "@dataclass\n"
        "class Cfg:\n"
        "    bonus: float = 0.5\n"
        "def length_reward(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return len(solution_str) / 10 + Cfg().bonus * (solution_str == ground_truth)\n"
    )
    fn = load_reward_fn(f"{path}:length_reward")
    assert fn("custom", "abcde", "abcde") == 1.0
    assert fn("custom", "abc", "x", {"k": 1}) == pytest.approx(0.3)


def test_make_reward_adds_format_bonus(tmp_path: Path) -> None:
    plain = make_reward(None)
    assert plain is default_compute_score
    shaped = make_reward(None, format_weight=0.2)
    assert shaped("gsm8k", "work\n#### 72", "72") == pytest.approx(1.2)
    assert shaped("gsm8k", "work\n#### 71", "72") == pytest.approx(0.2)
    assert shaped("gsm8k", "72", "72") == 0.0
    path = tmp_path / "r.py"
    path.write_text("def zero(data_source, solution_str, ground_truth, extra_info=None):\n    return 0\n")
    assert make_reward(f"{path}:zero", format_weight=0.5)("x", "#### 3", "3") == 0.5


def _spec_error(spec: str) -> str:
    with pytest.raises(RewardError) as excinfo:
        load_reward_fn(spec)
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_bad_custom_fn_specs(tmp_path: Path) -> None:
    path = tmp_path / "r.py"
    path.write_text("THRESHOLD = 3\ndef score(*args):\n    return 1.0\n")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_real_module_xyz\n")

    not_a_spec = "is not of the form path/to/file.py:function"
    assert _spec_error("reward.py") == f"algorithm.reward_fn='reward.py' {not_a_spec}"
    assert _spec_error(f"{path}:") == f"algorithm.reward_fn='{path}:' {not_a_spec}"
    assert _spec_error(f"{tmp_path}/missing.py:score") == (
        f"algorithm.reward_fn file not found: {tmp_path}/missing.py (from {Path.cwd()}; give an existing .py file, "
        "relative to the folder the run starts in, or an absolute path)"
    )
    assert _spec_error(f"{path}:nope") == (
        f"algorithm.reward_fn file {path} has no function 'nope' (define it or fix the name after the colon)"
    )
    assert _spec_error(f"{path}:THRESHOLD") == f"algorithm.reward_fn {path}:THRESHOLD is a int, not a function"
    assert _spec_error(f"{broken}:score") == (
        f"algorithm.reward_fn file {broken} failed to import: "
        "ModuleNotFoundError: No module named 'not_a_real_module_xyz'"
    )
    with pytest.raises(RewardError, match=r"^safety.cost_fn file not found: missing.py "):  # the key at fault
        load_reward_fn("missing.py:score", "safety.cost_fn")
