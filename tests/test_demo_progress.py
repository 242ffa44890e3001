"""Progress of `alignrl demo`'s long phases as a user sees it: a short demo under a pseudo-terminal draws a live bar
for each phase (held-out evaluation, pass@k, the GRPO loop, checkpoint writes), and the same run into a pipe prints
each phase's one closing line with its seconds and no terminal control codes. The demo base model's SFT (which a
demo runs only when the shipped build does not match its recipe) is checked the same way on a tiny recipe."""

import os
import re
import select
import signal
import struct
import subprocess
import sys
import time

import pytest
from rich.console import Console

from conftest import TEST_RECIPE, run_group, src_path

# a few seconds of the demo: the shipped base model, two steps of 4 prompts x 4 samples, 8 held-out problems;
# an evaluation and a checkpoint at each step, pass@4 before and after (trainer.eval_pass_at_k is on in the demo)
SHORT = ["data.train_size=32", "data.val_size=8", "data.val_size_during_training=4", "data.train_batch_size=4",
         "rollout.n=4", "rollout.max_new_tokens=8", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=16",
         "trainer.total_training_steps=2", "trainer.test_freq=1", "trainer.save_freq=1"]
CAP_S = 600  # a generous cap on one run; nothing here measures time
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
BAR = "━"  # rich's bar glyph, done and to-do parts alike
# rich >= 14.1 nests a live display in another: a checkpoint's bar shows under the loop's
NESTS = hasattr(Console(), "_live_stack")


def _env(tmp_path, terminal: bool) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS", "LINES")}
    env.update(PYTHONPATH=src_path(), OMP_NUM_THREADS="1", ALIGNRL_CACHE=str(tmp_path / "cache"),
               TOKENIZERS_PARALLELISM="false")
    if terminal:
        env.update(TERM="xterm", COLUMNS="120", LINES="40")
    else:
        env.pop("TERM", None)
    return env


def on_pty(cmd: list[str], env: dict) -> tuple[int, str]:
    """(exit code, everything written) of `cmd` with stdin, stdout and stderr on a pseudo-terminal of 120 columns,
    read until the child side closes (its exit); the process group is killed past CAP_S."""
    import fcntl
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + CAP_S
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"{cmd[2:4]} ran past {CAP_S}s on the pseudo-terminal; it wrote:\n"
                            + b"".join(chunks).decode(errors="replace")[-3000:])
            ready, _, _ = select.select([master], [], [], min(left, 5.0))
            if not ready:
                continue
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: every holder of the terminal's other side is gone
                break
            if not data:
                break
            chunks.append(data)
        return proc.wait(timeout=60), b"".join(chunks).decode("utf-8", errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:  # past the cap, or the test failed while reading: the whole group goes
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)


def frames(text: str) -> list[str]:
    """What the terminal showed, as the lines of each redraw: control codes out, split at line feeds and carriage
    returns (rich redraws a bar by going back to the start of its line)."""
    return [x for x in re.split(r"[\r\n]", ANSI.sub("", text)) if x.strip()]


def drew_bar(text: str, name: str) -> bool:
    """A line that starts with the phase's name and goes on with its bar."""
    return any(re.match(rf"\s*{re.escape(name)}\s+[{BAR}╸╺]", line) for line in frames(text))


def _demo(tmp_path) -> list[str]:
    return [sys.executable, "-m", "alignrl", "demo", *SHORT, f"trainer.output_dir={tmp_path / 'out'}"]


PHASES = ["held-out evaluation", "base model pass@4", "GRPO", "trained model pass@4"]
CHECKPOINTS = ["checkpoint global_step_1", "checkpoint global_step_2"]


@pytest.mark.slow
def test_each_long_phase_of_the_demo_draws_a_live_bar_on_a_terminal(tmp_path):
    code, text = on_pty(_demo(tmp_path), _env(tmp_path, terminal=True))
    assert code == 0, text[-3000:]
    # a live display: the cursor hidden while the bars redraw in place (carriage returns, erased lines)
    assert "\x1b[?25l" in text and "\r" in text and ("\x1b[2K" in text or "\x1b[1A" in text), text[-2000:]
    for name in PHASES:
        assert drew_bar(text, name), f"no bar for {name!r}:\n" + "\n".join(frames(text))[-3000:]
    for name in CHECKPOINTS:  # inside the loop's bar: nested under it, or (older rich) its closing line
        assert drew_bar(text, name) if NESTS else re.search(rf"{name}: 2/2 parts in \d+\.\ds", text), name
    shown = "\n".join(frames(text))
    assert "base_accuracy=" in shown and "step 2" in shown


@pytest.mark.slow
def test_off_a_terminal_each_phase_prints_one_line_with_its_seconds_and_no_control_codes(tmp_path):
    done = run_group(_demo(tmp_path), CAP_S, env=_env(tmp_path, terminal=False))
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout + done.stderr
    assert "\x1b" not in out and "\r" not in out, out[-2000:]
    lines = out.splitlines()
    seconds = r"\(\d+\.\ds\)"
    one_each = [rf"base model held-out greedy accuracy: .* on 8 problems {seconds}",  # the evaluation's
                rf"base model held-out room on 8 problems {seconds}:",  # pass@4's
                rf"final held-out greedy accuracy: .* on 8 problems {seconds}",
                rf"trained model held-out room on 8 problems {seconds}:",
                r"checkpoint global_step_1: 2/2 parts in \d+\.\ds", r"checkpoint global_step_2: 2/2 parts in \d+\.\ds"]
    for pattern in one_each:
        assert sum(bool(re.fullmatch(pattern, x)) for x in lines) == 1, (pattern, out[-3000:])
    # the loop: one line a step with its seconds
    for step in (1, 2):
        assert sum(bool(re.match(rf"step {step}\s.*s/step=[\d.e+-]+$", x)) for x in lines) == 1, out[-3000:]


@pytest.mark.slow
def test_the_demo_base_models_sft_draws_a_bar_on_a_terminal_and_says_its_seconds_elsewhere(tmp_path):
    """The build a demo runs when no build of its recipe is cached or shipped, on a recipe of a few seconds."""
    recipe = {**TEST_RECIPE, "sft_steps": 8, "sft_batch_size": 4}
    build = (f"from pathlib import Path; from alignrl.models.tiny import TinyRecipe, build_demo_model; "
             f"import sys; build_demo_model(Path(sys.argv[1]), TinyRecipe(**{recipe!r}))")
    code, text = on_pty([sys.executable, "-c", build, str(tmp_path / "a")], _env(tmp_path, terminal=True))
    assert code == 0, text[-3000:]
    assert drew_bar(text, "demo base model SFT"), "\n".join(frames(text))[-3000:]
    done = run_group([sys.executable, "-c", build, str(tmp_path / "b")], CAP_S, env=_env(tmp_path, terminal=False))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "\x1b" not in done.stdout and "\r" not in done.stdout and BAR not in done.stdout, done.stdout
    assert re.search(r"^  sft step 8/8 loss [\d.]+ \(\d+s\)$", done.stdout, re.M), done.stdout
    assert re.search(r"^demo base model ready in \d+s: ", done.stdout, re.M), done.stdout
