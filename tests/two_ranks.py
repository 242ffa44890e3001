"""Two threads standing in for two ranks, for math that sums statistics over ranks (`sum_ranks`)."""

from __future__ import annotations

import threading


def on_two_ranks(fn, combine=lambda first, second: first + second):
    """[fn(0, across), fn(1, across)], each run on its own thread; `across(t)` returns combine(rank 0's t, rank
    1's t): their sum by default, as an all-reduce gives, or e.g. their concatenation, as an all-gather gives."""
    barrier, slots, out = threading.Barrier(2, timeout=60), [None, None], [None, None]

    def make_sum(rank):
        def total(t):
            slots[rank] = t.clone()
            barrier.wait()
            combined = combine(slots[0], slots[1])
            barrier.wait()  # both read before either writes the next round
            return combined
        return total

    def run(rank):
        out[rank] = fn(rank, make_sum(rank))

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    assert not any(t.is_alive() for t in threads), "a rank thread did not finish"
    return out
