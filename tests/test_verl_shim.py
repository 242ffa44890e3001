"""Seed 003's `python3 -m verl.trainer.main_ppo` run by a Python without alignrl (a Ray started from another
environment runs the job's command with its own Python): one line saying so and what to do, no traceback."""

import os
import subprocess
import sys
from pathlib import Path


def test_the_verl_shim_without_alignrl_says_so_in_one_line():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # -S: no site-packages, so neither the installed alignrl nor its editable path; the checkout's verl/ is found
    out = subprocess.run([sys.executable, "-S", "-m", "verl.trainer.main_ppo", "trainer.total_training_steps=1"],
                         cwd=Path(__file__).parents[1], env=env, capture_output=True, text=True, timeout=60)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert "cannot import alignrl: alignrl is not installed in this Python" in lines[0], lines
