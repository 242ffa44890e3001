"""logs/prompts.jsonl of the ZeroMQ trainer: which dataset rows each step trained on, the exactly-once account
of a run with killed samplers and trainers (tests read it)."""

from __future__ import annotations

import json
from pathlib import Path

from alignrl.utils.atomic import atomic_write_text
from alignrl.utils.tracking import aside, json_rows


class RowLog:
    def __init__(self, log_dir: Path):
        self.path = log_dir / "prompts.jsonl"

    def start_fresh(self) -> None:
        """A run that starts fresh moves an earlier run's file aside: it accounts for this run's steps alone."""
        if self.path.is_file():
            self.path.rename(aside(self.path))

    def write(self, step: int, version: int, lease: str | None, sampler: str, rows: list[int]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "version": version, "lease": lease, "sampler": sampler,
                                "rows": sorted(set(rows))}) + "\n")

    def keep_until(self, step: int) -> None:
        """Forgets the steps after `step` (a resume trains them again); a line a kill left torn goes with them."""
        if self.path.is_file():
            keep = [r for r in json_rows(self.path.read_text()) if r.get("step", 0) <= step]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in keep))
