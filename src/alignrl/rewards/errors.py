"""The reward stage's one-line errors: a reward setting that cannot be used, and a user's function that failed
on one row. Apart from the registry so that what the registry loads (OpenRLHF's reward files) can raise them."""

from __future__ import annotations

from alignrl.errors import UserError


class RewardError(UserError):
    """The reward configuration cannot be used; the message says what to change."""


class ScoreError(RewardError):
    """A reward or cost function raised, or returned something other than a finite real number, for one
    row. The function's wrapper knows the function and the data_source; the reward stage, which knows
    the row, re-raises `at(row, kind)`: the one-line message names all of them."""

    def __init__(self, who: str, problem: str, data_source: str, fix: str, row: int | str | None = None,
                 kind: str = "reward function"):
        """`row`: an index into the scored rows, or the row's place in its data file ("x.parquet row 3")."""
        self.who, self.problem, self.data_source, self.fix = who, problem, data_source, fix
        self.row, self.kind = row, kind
        at = "" if row is None else f" for row {row}" if isinstance(row, int) else f" for {row}"
        super().__init__(f"{kind} {who} {problem}{at} (data_source {data_source}): {fix}")

    def __reduce__(self):  # rebuilt from its parts where it crosses processes (a Ray worker's error)
        return ScoreError, (self.who, self.problem, self.data_source, self.fix, self.row, self.kind)

    def at(self, row: int | str, kind: str) -> ScoreError:
        return ScoreError(self.who, self.problem, self.data_source, self.fix, row, kind)
