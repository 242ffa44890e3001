"""Progress of the long phases: the helper's bar on a terminal and one closing line elsewhere, and the phases'
callbacks counting up to their totals."""

import io
import re

import pytest
from rich.console import Console

from alignrl.rl.evaluate import heldout_eval, room
from alignrl.rewards.registry import load_reward_fn
from alignrl.utils.progress import Phase
from test_evaluate_room import TEXTS, TOKENIZER, ScriptedEngine, _sample


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=100, highlight=False), out


def test_off_a_terminal_a_phase_prints_one_line_with_its_seconds():
    console, out = _console(False)
    with Phase("index build", 3, "chunks", console=console) as p:
        for _ in range(3):
            p.advance()
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    assert re.fullmatch(r"index build: 3/3 chunks in \d+\.\ds", lines[0])
    assert p.done == 3 and p.seconds >= 0


def test_a_phase_that_its_caller_reports_or_that_fails_prints_nothing_off_a_terminal():
    console, out = _console(False)
    with Phase("evaluation", 2, console=console, say=False) as p:
        p.advance(2)
    with pytest.raises(RuntimeError), Phase("build", 2, console=console):
        raise RuntimeError("stopped")
    assert out.getvalue() == ""


def test_on_a_terminal_a_phase_draws_a_bar_and_no_closing_line():
    console, out = _console(True)
    with Phase("held-out evaluation", 4, "problems", console=console) as p:
        p.advance(4)
    text = out.getvalue()
    assert "held-out evaluation" in text and "4/4" in text
    assert " in " not in text.replace("held-out evaluation", "")


def test_a_phase_inside_another_bar_still_counts():
    console, _ = _console(True)
    with Phase("RL", 1, console=console), Phase("evaluation", 2, console=console) as inner:
        inner.advance(2)
    assert inner.done == 2


def _scripted(n: int):
    samples = [_sample("5", 1) for _ in range(n)]
    engine = ScriptedEngine({0: TEXTS[0]}, {0: [TEXTS[0], TEXTS[2]]})
    return samples, engine, [[0]] * n


def test_heldout_evaluation_tells_its_progress_batch_by_batch_up_to_the_total():
    samples, engine, prompts = _scripted(5)
    counts = []
    acc = heldout_eval(engine, TOKENIZER, samples, prompts, load_reward_fn(None), 8, batch_size=2,
                       progress=counts.append)
    assert counts == [2, 2, 1] and sum(counts) == len(samples)
    assert acc["accuracy"] == 1.0


def test_pass_at_k_tells_its_progress_greedy_then_sampled():
    samples, engine, prompts = _scripted(3)
    with Phase("pass@2", 2 * len(samples), console=_console(False)[0]) as p:
        room(engine, TOKENIZER, samples, prompts, load_reward_fn(None), 8, k=2, temperature=1.0, batch_size=1,
             progress=p.advance)
    assert p.done == p.total == 6


def test_dense_encoder_tells_each_chunk(monkeypatch):
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    from alignrl.retrieval.dense import Encoder

    class Tok:
        def __call__(self, batch, **_):
            return _Enc({"input_ids": torch.ones(len(batch), 2, dtype=torch.long),
                         "attention_mask": torch.ones(len(batch), 2, dtype=torch.long)})

    class _Enc(dict):
        def to(self, _):
            return self

    class Model(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            return type("Out", (), {"last_hidden_state": torch.ones(*input_ids.shape, 4)})()

    enc = Encoder.__new__(Encoder)
    enc.spec = type("Spec", (), {"query_prefix": "", "passage_prefix": "", "max_length": 8})()
    enc.tokenizer, enc.model, enc.device, enc.calls, enc.texts_encoded = Tok(), Model(), "cpu", 0, 0
    counts = []
    vectors = enc.encode(["a"] * 5, is_query=False, batch_size=2, progress=counts.append)
    assert counts == [2, 2, 1] and vectors.shape == (5, 4) and isinstance(vectors, np.ndarray)
