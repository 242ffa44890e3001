"""verl's DAPO math reward (data_source math_dapo and aime*: +1/-1 by the last "Answer:" line, Minerva-normalized, or
a strict \\boxed{} check), and verl's reward_score modules as a user's reward file written for verl imports them."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

from alignrl.rewards import code, math_dapo, qa_em, verl_reward_modules
from alignrl.rewards.math_dapo import compute_score, normalize_final_answer
from alignrl.rewards.registry import REWARDS, default_compute_score, ground_truth_problem, load_reward_fn


@pytest.mark.parametrize(("raw", "expected"), [
    ("42", "42"),
    ("  42.  ", "42."),
    ("x = 5", "5"), ("a = b = 7", "7"),  # what follows the last "="
    ("10 dollars", "10"), ("5 cm", "5"), ("12 \\text{ meters}", "12"), ("90^\\circ", "90"), ("90^{\\circ}", "90"),
    ("\\text{Tuesday}", "Tuesday"), ("\\textbf{(C)}", "(C)"), ("\\overline{AB}", "AB"), ("\\mbox{yes}", "yes"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\frac12", "\\frac{1}{2}"), ("\\frac123", "\\frac{1}{2}3"), ("\\sqrt2", "\\sqrt{2}"), ("\\sqrt{3}", "\\sqrt{3}"),
    ("1,000", "1000"), ("1,234,567", "1234567"), ("1{,}000", "1000"), ("1,\\!000", "1000"),
    ("1, 2", "12"),  # digits and commas alone are read as one number, a list of numbers too (verl's rule)
    ("x, y", "x,y"), ("x \\text{and} y", "x,y"),
    ("$\\frac{3}{4}$ of it", "\\frac{3}{4}"), ("it is $7$ and $8$", "7"),  # the first math span
    ("\\$18.90", "18.90"),
    ("a 5", "5"), ("an apple", "apple"),
    ("3 \\text{m}", "3"),
    ("x, y, \\ldots", "x,y,"),
])
def test_normalization_follows_the_minerva_rules(raw: str, expected: str) -> None:
    assert normalize_final_answer(raw) == expected


@pytest.mark.parametrize(("response", "truth", "score", "pred"), [
    ("Let me think.\nAnswer: 42", "42", 1.0, "42"),
    ("answer : 42\n", "42", 1.0, "42"),  # any case, spaces around the colon
    ("ANSWER:\n42", "42", 1.0, "42"),  # the spaces after the colon may include a line break
    ("Answer: 41\nno wait\nAnswer: 42", "42", 1.0, "42"),  # the last answer line
    ("Answer: 42\nno wait\nAnswer: 41", "42", -1.0, "41"),
    ("Answer: $\\frac{1}{2}$", "\\frac12", 1.0, "\\frac{1}{2}"),
    ("Answer: 1,000 dollars", "1000", 1.0, "1000"),
    ("Answer: x = 3", "3", 1.0, "3"),
    ("The final answer is \\boxed{42}", "42", -1.0, "[INVALID]"),  # a box is not an answer line
    ("Answer: 0.5", "\\frac{1}{2}", -1.0, "0.5"),  # no symbolic equivalence: text after normalization
    ("", "42", -1.0, "[INVALID]"),
])
def test_answer_line_scores_plus_or_minus_one(response: str, truth: str, score: float, pred: str) -> None:
    assert compute_score(response, truth) == {"score": score, "acc": score > 0, "pred": pred}


def test_only_the_last_300_characters_are_read() -> None:
    early = "Answer: 42\n" + "x" * 300
    assert compute_score(early, "42")["score"] == -1.0
    assert compute_score("x" * 1000 + "\nAnswer: 42", "42")["score"] == 1.0


def test_numeric_references_are_read_as_text() -> None:
    assert compute_score("Answer: 204", 204)["score"] == 1.0  # an AIME answer stored as an integer column
    with pytest.raises(TypeError, match="not text or a number"):
        compute_score("Answer: 1", None)


def test_strict_box_verify() -> None:
    assert compute_score("so \\boxed{42}", "42", strict_box_verify=True) == {"score": 1.0, "acc": True, "pred": "42"}
    # compared as written: no normalization, and the last box wins
    assert compute_score("\\boxed{42} \\boxed{ 42}", "42", strict_box_verify=True)["pred"] == " 42"
    assert compute_score("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True)["score"] == 1.0
    assert compute_score("\\boxed{\\frac12}", "\\frac{1}{2}", True)["score"] == -1.0
    # only the last 100 characters are searched; an unclosed box is no answer
    far = compute_score("\\boxed{42}" + " " * 100, "42", True)
    assert far == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert compute_score("\\boxed{42", "42", True)["pred"] == "[INVALID]"
    assert compute_score("Answer: 42", "42", True)["score"] == -1.0


def test_strict_box_from_the_last_pause_token() -> None:
    text = "\\boxed{7}" + "y" * 150  # the box is too far from the end...
    assert compute_score(text, "7", True)["pred"] == "[INVALID]"
    assert compute_score(text, "7", True, pause_tokens_index=[0, 0, 0, 100])["score"] == 1.0  # ...not from the pause
    with pytest.raises(ValueError, match="give 4"):
        compute_score(text, "7", True, pause_tokens_index=[100])


def test_boxed_helpers_and_a_boxed_reference() -> None:
    assert math_dapo.last_boxed_only_string("a \\boxed{1} b \\boxed{x^{2}} c") == "\\boxed{x^{2}}"
    assert math_dapo.last_boxed_only_string("no box") is None
    assert math_dapo.remove_boxed("\\boxed{x^{2}}") == "x^{2}"
    assert math_dapo.is_correct_minerva("Answer: 5", "so \\boxed{5}", gt_need_extract=True) == (True, "5")


def test_registry_routes_math_dapo_and_aime_sets_with_plus_minus_one() -> None:
    for source in ("math_dapo", "aime_2024", "aime2025", "aime"):
        assert source in REWARDS and REWARDS[source] is math_dapo.compute_score
        assert REWARDS.get(source) is math_dapo.compute_score
        assert default_compute_score(source, "Answer: 204", "204") == 1.0
        assert default_compute_score(source, "Answer: 203", "204") == -1.0
        assert default_compute_score(source, "\\boxed{204}", "204") == -1.0  # verl's rule reads the answer line
    assert "my_aime" not in REWARDS and REWARDS.get("my_aime") is None
    with pytest.raises(KeyError):
        REWARDS["my_aime"]


def test_ground_truth_problem_for_the_dapo_reward() -> None:
    assert ground_truth_problem("aime_2024", "204") is None
    assert ground_truth_problem("math_dapo", 204) is None
    for bad in (None, ["204"], {"target": "204"}, "  dollars "):
        problem = ground_truth_problem("math_dapo", bad)
        assert problem is not None and "DAPO math reward of data_source 'math_dapo'" in problem, bad


@pytest.fixture
def fresh_verl_modules():
    """Removes what a test registered under verl's names, so that the next test starts as a fresh process does."""
    before = {name: module for name, module in sys.modules.items() if name == "verl" or name.startswith("verl.")}
    yield
    for name in [n for n in sys.modules if (n == "verl" or n.startswith("verl.")) and n not in before]:
        del sys.modules[name]
        parent, _, leaf = name.rpartition(".")
        if parent in before and getattr(before[parent], leaf, None) is not None:
            delattr(before[parent], leaf)


USER_FILE = '''
from verl.utils.reward_score import default_compute_score, gsm8k, math_dapo
import verl.utils.reward_score.math_dapo
from verl.utils.reward_score.math import compute_score as math_score
from verl.utils.reward_score.search_r1_like_qa_em import compute_score as qa_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "my_dapo":
        return math_dapo.compute_score(solution_str, ground_truth)  # a dict: its "score" is the reward
    if data_source == "my_strict":
        return verl.utils.reward_score.math_dapo.compute_score(solution_str, ground_truth, strict_box_verify=True)
    if data_source == "my_math":
        return math_score(solution_str, ground_truth)
    if data_source == "my_qa":
        return qa_score(solution_str, {"target": [ground_truth]}, "strict", 0.1, 1.0)
    if data_source == "my_gsm8k":
        return gsm8k.compute_score(solution_str, ground_truth, method="flexible")
    return default_compute_score(data_source, solution_str, ground_truth, extra_info, sandbox_fusion_url=None,
                                 concurrent_semaphore=None, memory_limit_mb=1024)
'''


def test_a_verl_reward_file_imports_verls_modules_and_scores(tmp_path: Path, fresh_verl_modules) -> None:
    path = tmp_path / "verl_reward.py"
    path.write_text(USER_FILE)
    fn = load_reward_fn(f"{path}:compute_score")
    assert fn("my_dapo", "Answer: 12", "12") == 1.0 and fn("my_dapo", "Answer: 11", "12") == -1.0
    assert fn("my_strict", "\\boxed{12}", "12") == 1.0
    assert fn("my_math", "\\boxed{1/2}", "0.5") == 1.0
    assert fn("my_qa", "<answer>Paris</answer>", "paris") == 1.0 and fn("my_qa", "<answer>Rome</answer>", "x") == 0.1
    assert fn("my_gsm8k", "it is 7.", "7") == 1.0
    assert fn("aime_2024", "Answer: 204", "204") == 1.0 and fn("math_dapo", "Answer: 1", "2") == -1.0
    assert fn("openai/gsm8k", "#### 3", "3") == 1.0


def test_provided_default_compute_score_is_verls(fresh_verl_modules) -> None:
    verl_reward_modules.provide(REWARDS)
    from verl.utils.reward_score import _default_compute_score
    from verl.utils.reward_score import default_compute_score as verl_default

    assert verl_default("math_dapo", "Answer: 3", "3") == {"score": 1.0, "acc": True, "pred": "3"}  # verl's dict
    assert verl_default("openai/gsm8k", "#### 3", "3", None, sandbox_fusion_url=None, new_option=1) == 1.0
    assert _default_compute_score is verl_default
    with pytest.raises(NotImplementedError, match="my/data"):
        verl_default("my/data", "x", "y")
    verl_reward_modules.provide(REWARDS)  # again: the registered modules stay
    from verl.utils.reward_score import default_compute_score as again

    assert again is verl_default


def test_code_sets_run_locally_or_on_the_given_sandbox() -> None:
    assert verl_reward_modules.code_reward(None, None) is code.LOCAL
    remote = verl_reward_modules.code_reward("http://127.0.0.1:9/run_code", 512)
    assert remote.settings.memory_mb == 512 and remote.runner.url == "http://127.0.0.1:9/run_code"
    assert verl_reward_modules.code_reward("http://127.0.0.1:9/run_code", 512) is remote  # one client a URL


def test_search_r1_module_has_verls_signature() -> None:
    text = "<answer>Paris</answer>" * 6 + "<answer>Paris</answer>" * 5
    assert verl_reward_modules.search_r1_compute_score(text, {"target": ["Paris"]}, "strict", 0.0, 1.0) == 0.25
    assert verl_reward_modules.search_r1_compute_score("no tag", ["Paris"]) == 0.0
    assert qa_em.extract_answer("<answer> a </answer><answer> b </answer>") == "b"


def test_an_installed_verl_is_left_as_it_is(fresh_verl_modules, monkeypatch) -> None:
    def theirs(*args, **kwargs):
        return 0.5

    # what earlier tests of this process provided under verl's names is set aside: an installed verl has its own
    for name in [n for n in sys.modules if n.startswith("verl.utils")]:
        monkeypatch.delitem(sys.modules, name)

    for name in ("verl", "verl.utils", "verl.utils.reward_score"):
        module = sys.modules.get(name) or ModuleType(name)
        module.__path__ = getattr(module, "__path__", [])
        sys.modules[name] = module
    sys.modules["verl.utils.reward_score"].default_compute_score = theirs
    assert not verl_reward_modules.verl_missing()
    verl_reward_modules.provide(REWARDS)
    assert "verl.utils.reward_score.math_dapo" not in sys.modules
    assert sys.modules["verl.utils.reward_score"].default_compute_score is theirs
