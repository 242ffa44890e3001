"""Notes about an offline trainer's config (a repeated, unused or foreign key), said once per run."""

from __future__ import annotations

import os
import sys

NOTES_SAID = "ALIGNRL_PREFERENCE_NOTES_SAID"  # set for the ranks of `--nproc`: the parent said the notes already


def say(text: str) -> None:
    """A note about the config, once per run: on rank 0, and not again in the ranks of `--nproc` (their parent said
    it)."""
    if os.environ.get("RANK", "0") == "0" and not os.environ.get(NOTES_SAID):
        print(f"alignrl: {text}", file=sys.stderr, flush=True)
