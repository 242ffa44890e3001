"""verl's geo3k reward (hiyouga/geometry3k rows: 0.9 x a right boxed answer + 0.1 x the <think> format) and PRIME's
math reward (the numina_* sets: 1.0 for a right answer, picked as verl's prime_math picks it), their routing, their
verl modules as a user's reward file imports them, and a geo3k row of verl's parquet layout passing the data checks."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from alignrl.config import load_config
from alignrl.data.loaders import DataError, check_sources
from alignrl.data.prompts import load_task_data
from alignrl.rewards import geo3k, prime_math, ruler
from alignrl.rewards import math as math_reward
from alignrl.rewards.huge_numbers import huge
from alignrl.rewards.registry import REWARDS, default_compute_score, finite_score, ground_truth_problem, load_reward_fn
from alignrl.rewards.values import is_correct
from alignrl.rewards.verl_reward_modules import make_default_compute_score as verl_default

NUMINA = ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc", "numina_cn_k12",
          "numina_olympiads")


@pytest.mark.parametrize(("response", "truth", "score"), [
    ("<think>half of 3 times 4</think>The area is \\boxed{6}.", "6", 1.0),  # 0.9 x 1 + 0.1 x 1
    ("The area is \\boxed{6}.", "6", 0.9),  # right, no thinking block: 0.9 x 1 + 0.1 x 0
    ("<think>guess</think>\\boxed{7}", "6", 0.1),  # wrong, well formed: 0.9 x 0 + 0.1 x 1
    ("The area is 6.", "6", 0.0),  # no box: the answer read is "None", and no format
    ("Sure! <think>x</think>\\boxed{6}", "6", 0.9),  # text before <think>: not the format
    ("<think>x \\boxed{6}", "6", 0.9),  # <think> never closed
    ("<think>x</think>\\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1.0),  # equal under sympy
    ("<think>x</think>\\boxed{60^\\circ}", "60", 1.0),  # degrees dropped by the normal form
    ("<think>x</think>\\boxed{\\frac{1}{2}} then \\boxed{3}", "3", 1.0),  # the last box is the answer
    ("<think>x</think>\\boxed{6}", 6, 1.0),  # a number as the reference
])
def test_geo3k_scores_accuracy_and_format(response: str, truth: object, score: float) -> None:
    assert geo3k.compute_score(response, truth) == pytest.approx(score)


def test_geo3k_right_and_formatted_is_exactly_one() -> None:
    """Held-out accuracy counts a score >= 1.0 as solved: 0.9 + 0.1 must not round below it."""
    assert geo3k.compute_score("<think>a</think>\\boxed{3}", "3") == 1.0
    assert geo3k.compute_score("\\boxed{3}", "3", format_score=0.5) == 0.5
    assert geo3k.acc_reward("3", "3", use_boxed=False) == 1.0 and geo3k.acc_reward("3", "3") == 0.0


def test_geo3k_format_is_verls_pattern_in_linear_time() -> None:
    verl = re.compile(geo3k.FORMAT_PATTERN, re.DOTALL)
    for text in ("<think></think>\\boxed{}", "<think>a</think>b\\boxed{c}d", "<think>\\boxed{1}</think>", "<think>",
                 "<think></think>\\boxed{", "<think></think>}\\boxed{", " <think></think>\\boxed{1}",
                 "<think>\n</think>\n\\boxed{\n}\n", "<think></think></think>\\boxed{1}", ""):
        assert geo3k.format_reward(text) == (1.0 if verl.fullmatch(text) else 0.0), text


@pytest.mark.timeout(30)  # verl's regex takes minutes on this degenerate response; one pass takes microseconds
def test_geo3k_format_of_a_degenerate_loop_is_decided_at_once() -> None:
    assert geo3k.format_reward("<think>" + "</think>\\boxed{ " * 3000) == 0.0


@pytest.mark.parametrize(("response", "matched", "answer"), [
    ("So the answer is \\boxed{\\frac{1}{2}}.", True, "\\frac{1}{2}"),
    ("Answer: 42", True, "42"),
    ("The answer is 5. So we are done.", True, "5"),  # cut at the last ". "
    ("We get x = 7. Done", True, "7"),  # then what follows the last "="
    ("Thus 12 is the answer", True, "Thus 12"),  # what precedes "is the answer"
    ("\\fbox{8}", True, "8"),
    ("no digits here", False, "no digits here"),  # nothing marked: the whole response is graded
    ("The answer is \\boxed{x}", False, "x"),  # marked, but an answer without a digit does not count as matched
])
def test_prime_math_picks_the_answer_as_prime_does(response: str, matched: bool, answer: str) -> None:
    assert prime_math.match_answer(response) == (matched, answer)


@pytest.mark.parametrize(("response", "truth", "expected"), [
    ("So \\boxed{\\frac{1}{2}}", "0.5", (True, True, "\\frac{1}{2}")),  # mathruler: equal normal forms
    ("The answer is 0.5", "\\frac12", (True, True, "0.5")),
    ("Step 1: add. Step 2: so \\boxed{3}", "4", (False, True, "3")),  # wrong, in prime's format
    ("\\boxed{3}", "4", (False, False, "3")),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", (True, True, "\\{1,2\\}")),  # math_verify: mathruler reads no sets
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", (True, True, "\\frac{2}{4}")),  # math_verify: mathruler wants 1/2
    ("\\boxed{10^3}", 1000, (True, True, "10^3")),  # math_verify, a number as the reference
    ("\\boxed{(1,2)}", "(2,1)", (False, False, "(1,2)")),  # an ordered pair is not a set
])
def test_prime_math_grades_with_mathruler_then_math_verify(response: str, truth: object, expected: tuple) -> None:
    assert prime_math.compute_score(response, truth) == expected
    assert prime_math.score(response, truth) == (1.0 if expected[0] else 0.0)


@pytest.mark.timeout(60)  # a guard that let them through would hang here for good
def test_answers_sympy_cannot_finish_are_compared_as_text(monkeypatch) -> None:
    """mathruler's sympy step (and math_verify) compute 9**9**9 or 9999999! in full, without a timeout, and
    math_verify takes seconds on a long unmarked response: neither is asked."""
    def never(*args, **kwargs):
        raise AssertionError(f"math_verify asked about {str(args)[:60]}")

    monkeypatch.setattr(math_reward, "answer_equals", never)
    for answer in ("9**9**9", "9999999!", "(9999999)!"):
        assert huge(answer) and not prime_math.score(f"\\boxed{{{answer}}}", "\\frac{1}{3}")
        assert geo3k.compute_score(f"\\boxed{{{answer}}}", "\\frac{1}{3}") == 0.0
    assert ruler.grade_answer("5!", "5!") and not huge("1,\\!000")  # TeX's thin space is not a factorial
    assert prime_math.score("lots of prose " * 2000, "7") == 0.0  # graded whole: too long for math_verify


def test_default_compute_score_routes_geo3k_and_the_numina_sets() -> None:
    assert REWARDS["hiyouga/geometry3k"] is geo3k.graded
    assert default_compute_score("hiyouga/geometry3k", "<think>a</think>\\boxed{6}", "6") == 1.0
    assert default_compute_score("hiyouga/geometry3k", "\\boxed{6}", "6") == pytest.approx(0.9)
    for source in NUMINA:
        assert REWARDS[source] is prime_math.score
        assert default_compute_score(source, "the answer is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
        assert default_compute_score(source, "the answer is \\boxed{\\frac{1}{3}}", "0.5") == 0.0


def test_a_ground_truth_these_rules_cannot_read_is_named() -> None:
    assert ground_truth_problem("hiyouga/geometry3k", "3") is None and ground_truth_problem("numina_cn_k12", 7) is None
    for source, rule in (("hiyouga/geometry3k", "geo3k"), ("numina_olympiads", "PRIME math")):
        for bad in (None, ["3"], {"target": "3"}, "  "):
            problem = ground_truth_problem(source, bad)
            assert problem is not None and f"the {rule} reward of data_source {source!r}" in problem, bad
            assert "\n" not in problem
    with pytest.raises(TypeError, match="the reference is a list"):
        prime_math.compute_score("\\boxed{3}", ["3"])


USER_FILE = '''
from verl.utils.reward_score import default_compute_score, geo3k, prime_math
from verl.utils.reward_score.prime_math import compute_score as prime_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "my_geo":
        return geo3k.compute_score(solution_str, ground_truth, use_boxed=True, format_score=0.2)
    if data_source == "my_prime":
        return float(prime_score(solution_str, ground_truth)[0])
    if data_source == "my_match":
        return 1.0 if prime_math.match_answer(solution_str)[0] else 0.0
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
'''


def test_a_verl_reward_file_imports_geo3k_and_prime_math(tmp_path: Path) -> None:
    path = tmp_path / "verl_reward.py"
    path.write_text(USER_FILE)
    fn = load_reward_fn(f"{path}:compute_score")
    assert fn("my_geo", "\\boxed{2}", "2") == pytest.approx(0.8)  # 0.8 x 1 + 0.2 x 0
    assert fn("my_prime", "Answer: 2", "2") == 1.0 and fn("my_prime", "Answer: 3", "2") == 0.0
    assert fn("my_match", "Answer: 2", "x") == 1.0
    assert fn("hiyouga/geometry3k", "<think>a</think>\\boxed{2}", "2") == 1.0
    assert fn("numina_amc_aime", "\\boxed{204}", "204") == 1.0


def geo3k_rows(ground_truth: object) -> list[dict]:
    """Two rows as verl's examples/data_preprocess/geo3k.py writes them: <image> in the prompt's text, the picture's
    bytes in the images column."""
    png = io.BytesIO()
    Image.new("RGB", (56, 56), (255, 0, 0)).save(png, format="PNG")
    prompt = ("<image>Find x. You FIRST think about the reasoning process as an internal monologue and then provide "
              "the final answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final "
              "answer MUST BE put in \\boxed{}.")
    return [{"data_source": "hiyouga/geometry3k", "prompt": [{"role": "user", "content": prompt}],
             "images": [{"bytes": png.getvalue()}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": ground_truth},
             "extra_info": {"split": "train", "index": i, "answer": "3", "question": "Find x."}} for i in range(2)]


def test_a_verl_geo3k_parquet_passes_the_data_checks(tmp_path: Path) -> None:
    path = tmp_path / "geo3k.parquet"
    pq.write_table(pa.Table.from_pylist(geo3k_rows("3")), path)
    check_sources(str(path), REWARDS)  # the check before a launch: the data_source has a built-in reward
    train, val = load_task_data(load_config(None, [f"data.train_files={path}", f"data.val_files={path}"]))
    assert len(train) == len(val) == 2 and len(train[0].images) == 1
    assert train[0].data_source == "hiyouga/geometry3k" and train[0].ground_truth == "3"
    assert default_compute_score(train[0].data_source, "<think>a</think>\\boxed{3}", train[0].ground_truth) == 1.0
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(geo3k_rows(["3"])), bad)
    with pytest.raises(DataError, match=r"bad.parquet row 0: the reference is a list .*the geo3k reward"):
        load_task_data(load_config(None, [f"data.train_files={bad}", f"data.val_files={path}"]))


def test_verls_geo3k_tool_grades_each_answer_and_penalises_one_that_did_not_improve(tmp_path):
    """The tool of verl's multi-turn geo3k example (`verl.tools.geo3k_tool.Geo3kTool` in a tool config) is built in:
    an answer is graded whole by the geo3k rule's accuracy (no format term), and a call whose score did not beat the
    episode's last one gets verl's step reward of -0.05."""
    import asyncio

    from alignrl.rollout.verl_tools import load_tools

    config = tmp_path / "geo3k_tool_config.yaml"
    config.write_text('tools:\n  - class_name: "verl.tools.geo3k_tool.Geo3kTool"\n    config: {}\n'
                      '    tool_schema:\n      type: function\n      function:\n        name: calc_geo3k_reward\n'
                      '        description: grade\n        parameters: {type: object, properties: {answer: '
                      '{type: string}}, required: [answer]}\n')
    (tool,) = load_tools(str(config))

    async def episode():
        instance, _ = await tool.create(create_kwargs={"ground_truth": "\\frac{1}{2}"})
        calls = [await tool.execute(instance, {"answer": a}) for a in ("3", "0.5", "1/2", "7")]
        await tool.release(instance)
        return [(r.text, step) for r, step, _ in calls]

    assert asyncio.run(episode()) == [
        ("Current parsed answer='3' reward=0.0", -0.05),  # no better than the 0.0 it starts from
        ("Current parsed answer='0.5' reward=1.0", 0.0),
        ("Current parsed answer='1/2' reward=1.0", -0.05),  # right again: no improvement
        ("Current parsed answer='7' reward=0.0", -0.05)]


def test_a_right_answer_counts_as_solved_by_its_acc_not_by_reaching_1() -> None:
    """geo3k scores a right answer without the thinking block 0.9: the accuracy still counts it (its "acc", as verl's
    validation reports acc), and a user's verl function returning {"score", "acc"} is read the same way."""
    builtin = load_reward_fn(None)
    for response, score, right in (("\\boxed{6}", 0.9, True), ("<think>x</think>\\boxed{5}", 0.1, False),
                                   ("<think>x</think>\\boxed{6}", 1.0, True)):
        value = builtin("hiyouga/geometry3k", response, "6", None)
        assert (value, is_correct(value)) == (pytest.approx(score), right)
        assert type(verl_default(REWARDS)("hiyouga/geometry3k", response, "6")) is float  # verl's return type
    assert is_correct(finite_score({"score": 0.5, "acc": True}, "f", "s"))
    assert not is_correct(finite_score({"score": 2.0, "acc": 0}, "f", "s"))
    assert not is_correct(finite_score({"score": 0.5, "acc": 0.5}, "f", "s"))  # a partial acc is not solved
    assert is_correct(finite_score({"score": 1.0, "acc": "right"}, "f", "s"))  # not a verdict: information only
    assert is_correct(finite_score({"score": 1.0, "pred": "6"}, "f", "s")) and not is_correct(0.99)


@pytest.mark.timeout(60)  # math_verify computed \binom{10^9}{5 * 10^8} without end
def test_huge_binomials_and_gammas_are_compared_as_text() -> None:
    for answer in ("\\binom{1000000000}{500000000}", "\\dbinom{100000}{3}", "{123456 \\choose 2}", "\\Gamma(100000)"):
        assert prime_math.score(f"\\boxed{{{answer}}}", "5") == 0.0
        assert math_reward.compute_score(f"\\boxed{{{answer}}}", "5") == 0.0
    assert math_reward.compute_score("\\boxed{\\binom{5}{2}}", "10") == 1.0  # small ones are still worked out


@pytest.mark.timeout(60)  # the math reward (math_verify) computed 9999999! and (10^{100})! without end
def test_every_grader_compares_huge_factorials_and_towers_as_text() -> None:
    for answer in ("9999999!", "(10^{100})!", "10^{100}!", "9**9**9", "9^{9^{9}}", "2**1000000", "9^(9^9)", "2^{13!}",
                   "\\Gamma(10^{7})", "\\binom{10^{7}}{10^{6}}", "{10^{10}}!", "\\Gamma\\left(10^{7}\\right)",
                   "10^{99999 \\times 99999}", "10^{2 \\cdot 999999999}"):
        assert huge(answer), answer
        assert math_reward.compute_score(f"\\boxed{{{answer}}}", "5") == 0.0
        assert math_reward.compute_score(f"#### {answer}", answer) == 1.0  # the same text is still the same answer
        assert not ruler.grade_answer(answer, "\\frac{1}{3}") and geo3k.compute_score(f"\\boxed{{{answer}}}", "3") == 0
    for small in ("5!", "120", "2^{10}", "\\binom{5}{2}", "**5**", "1,\\!000", "x \\neq 3", "(a+b)^2", "(1+n)!", "{4}!",
                  "(3)!", "\\frac{(2n)!}{n!\\,n!}", "We are done (finally)! The answer is $5$.", "2^{n!}",
                  "(a+b)^{n}!", "10^{12}", "\\left(\\frac{1}{2}\\right)^{3}"):
        assert not huge(small), small
    # factorials of brackets are still worked out, and prose with an exclamation is graded as before
    for answer, truth in (("(1+n)!", "(n+1)!"), ("(3)!", "6"), ("{4}!", "24"),
                          ("\\frac{(2n)!}{n!\\,n!}", "\\binom{2n}{n}")):
        assert math_reward.compute_score(f"\\boxed{{{answer}}}", truth) == 1.0, answer
    assert math_reward.compute_score("We are done (finally)! The answer is $5$.", "5") == 1.0
    assert math_reward.compute_score("\\boxed{5!}", "120") == 1.0 and math_reward.answer_equals("2^{10}", "1024")
    assert math_reward.compute_score("The answer is **42**.", "42") == 1.0  # Markdown's bold is no power
