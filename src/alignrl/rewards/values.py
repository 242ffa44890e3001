"""What a reward function's row value may carry beside the reward itself."""

from __future__ import annotations


class RowScore(float):
    """A reward (a plain float wherever the reward is used) with what the function said beside it: the score dynamic
    filtering tests in its place (OpenRLHF's reward files return both: "rewards" train, "scores" filter), whether
    the answer is right (verl's "acc", which its validation reports as the accuracy: a rule whose right answers score
    below 1, as geo3k's 0.9 without the format, still counts them right), and the dict's numbers by key."""

    def __new__(cls, reward: float, filter_score: float | None = None, correct: bool | None = None,
                parts: dict[str, float] | None = None):
        obj = super().__new__(cls, reward)
        obj.filter_score = None if filter_score is None else float(filter_score)
        obj.correct = None if correct is None else bool(correct)
        obj.parts = parts or {}  # every number of a verl dict by its key: the components GDPO reads apart
        return obj


def plain_number(value: object) -> object:
    """A 0-d tensor or numpy scalar (what users' functions often return) as its Python number; else `value`."""
    return value.item() if hasattr(value, "item") and getattr(value, "ndim", 1) == 0 else value


def filter_score(value: object) -> float | None:
    """The score dynamic filtering tests for a row's reward value, None when it is the reward."""
    return getattr(value, "filter_score", None)


def is_correct(value: float) -> bool:
    """Whether a row's reward value counts as a right answer: the function's own "acc" where it gave one, else a
    score of 1 or more."""
    said = getattr(value, "correct", None)
    return value >= 1.0 if said is None else said


class TimedOut(float):
    """A row's 0.0 when its rule ran past algorithm.reward_timeout_s (`timed_rules`): a shaped reward adds no bonus
    to it, as the row was never scored."""
