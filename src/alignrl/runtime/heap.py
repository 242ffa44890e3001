"""The garbage collector's passes over what a process builds while it starts.

Starting a run imports torch and transformers and builds a model: about half a million objects that live as long
as the process. CPython's full collections walk every one of them: six or seven times while they are created
(~0.8 s of CPU a process here; every rank, sampler and service starts so) and again at exit (alignrl/__init__.py
freezes them there). A process's entry point calls `starting()`: full collections come ten times less often (the
young generations are still collected as usual, so a short-lived cycle goes at once; importing torch,
transformers, peft and DeepSpeed then takes one full pass instead of about eight) until start-up is over:
`settled()`, called once the first model is built (whole, sharded or on the meta device), a service starts serving,
or a launcher hands over to its ranks or Ray workers. It runs one full collection, freezes what survives (left out
of every later pass, as a server freezes its heap after start-up) and puts the thresholds back. A process that
never settles keeps collecting, ten times less often. A caller in its own process (a notebook, a test) never
called `starting()`: its collector settings and heap are left as they are.
"""

from __future__ import annotations

import gc

_saved: tuple[int, ...] | None = None  # the thresholds before starting(), while start-up lasts


def starting() -> None:
    """Full collections ten times less often until `settled()`."""
    global _saved
    if _saved is None:
        _saved = gc.get_threshold()
        gc.set_threshold(_saved[0], _saved[1], 10 * _saved[2])


def settled() -> None:
    """Start-up is over: one full collection, the survivors frozen, the thresholds as before."""
    global _saved
    if _saved is not None:
        gc.collect()
        gc.freeze()
        gc.set_threshold(*_saved)
        _saved = None
