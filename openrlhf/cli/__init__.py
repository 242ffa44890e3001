"""OpenRLHF's entry points, each a thin shim of an alignrl command: `train_ppo_ray` (alignrl train ppo-ray),
`train_kd` (alignrl train kd), `train_prm` (alignrl train prm), `train_opd` (alignrl train opd)."""

import sys


def run_as(words: list[str], module: str) -> None:
    """`python3 -m openrlhf.cli.<module> <flags>` is `alignrl <words> <flags>`: exits with its code. A Python without
    alignrl (a Ray started from another environment runs a job's command with its own) is told so in one line."""
    try:
        from alignrl.cli import main
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "alignrl":
            raise
        sys.exit(f"python3 -m openrlhf.cli.{module}: {sys.executable} cannot import {e.name}: alignrl is not "
                 "installed in this Python; run it (and `ray start`) from the environment alignrl is installed in "
                 "(`make install`, then .venv/bin/ray start ...)")
    sys.exit(main([*words, *sys.argv[1:]]))
