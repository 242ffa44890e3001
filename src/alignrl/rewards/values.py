"""What a reward function's row value may carry beside the reward itself."""

from __future__ import annotations


class FilteredScore(float):
    """A reward with the score dynamic filtering tests in its place: OpenRLHF's reward files return both ("rewards"
    train, "scores" filter). A plain float wherever the reward is used."""

    def __new__(cls, reward: float, filter_score: float):
        obj = super().__new__(cls, reward)
        obj.filter_score = float(filter_score)
        return obj


def filter_score(value: object) -> float | None:
    """The score dynamic filtering tests for a row's reward value, None when it is the reward."""
    return getattr(value, "filter_score", None)
