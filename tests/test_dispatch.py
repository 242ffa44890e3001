"""The dispatcher of the ZeroMQ trainer (alignrl.placements.zmq.leases): leases of prompt rows, their expiry, release
and requeue, and what a checkpoint keeps of them."""

import pytest

from alignrl.data.sampler import BatchSampler
from alignrl.placements.zmq.leases import Dispatcher


def test_a_checkpoint_whose_leases_hold_another_batch_size_is_one_line():
    """Its queued rows would be leased, refused and queued again for ever: the resume stops at once, saying how."""
    from alignrl.config import ConfigError

    before = Dispatcher(BatchSampler(64, 8, seed=0), max_staleness=0, lease_timeout_s=60, incarnation="a")
    leased = before.grant("s0", 0, now=0.0)
    state = before.state_dict()
    with pytest.raises(ConfigError, match=r"leased work of 8 prompts per step.*--batch-size 8.*a step now takes 4"):
        Dispatcher(BatchSampler(64, 4, seed=0), 0, 60, "b").load_state_dict(state)
    # the same batch size takes the queued rows first, with their number (the sampling seed: the samples the
    # uninterrupted run made), then new rows numbered on from there
    again = Dispatcher(BatchSampler(64, 8, seed=0), max_staleness=1, lease_timeout_s=60, incarnation="b")
    again.load_state_dict(state)
    first, second = again.grant("s0", 0, now=0.0), again.grant("s0", 0, now=0.0)
    assert (first.rows, first.number) == (leased.rows, leased.number) == (leased.rows, 1)
    order = BatchSampler(64, 8, seed=0)
    assert (second.rows, second.number) == ([order.next(), order.next()][1], 2)


def test_a_lease_expired_while_granting_another_is_kept_for_the_coordinators_line():
    """grant() expires leases past lease_timeout_s on its own: they wait in `late` until the coordinator says so."""
    d = Dispatcher(BatchSampler(64, 8, seed=0), max_staleness=0, lease_timeout_s=10, incarnation="a")
    hung = d.grant("hung", 0, now=0.0)
    taken = d.grant("other", 0, now=11.0)
    assert [lease.id for lease in d.late] == [hung.id] and taken.rows == hung.rows and d.expired == 1


def test_a_sampler_that_stops_releases_its_own_leases_and_the_expiry_count_survives_a_resume():
    d = Dispatcher(BatchSampler(64, 8, seed=0), max_staleness=2, lease_timeout_s=10, incarnation="a")
    mine, theirs = d.grant("me#1", 0, now=0.0), d.grant("you#2", 0, now=0.0)
    d.take(theirs.id)  # in training: never handed out again
    assert d.release("me#1") == [mine] and d.release("you#2") == []
    assert d.requeue == [(mine.rows, mine.number)] and list(d.outstanding) == [theirs.id]
    d.expired = 3
    again = Dispatcher(BatchSampler(64, 8, seed=0), max_staleness=2, lease_timeout_s=10, incarnation="b")
    again.load_state_dict(d.state_dict())
    assert again.expired == 3  # pipeline/leases_expired counts the run, not the launch
