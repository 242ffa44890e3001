"""The trainer's sync port (Coordinator._serve) in one process, with a stand-in weight board: a work
request that the staleness bound holds back is parked and answered the moment the next publish frees a
lease, with no polling by the sampler; one parked too long is answered "wait"."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from alignrl.config import load_config
from alignrl.data.sampler import BatchSampler
from alignrl.dist import coordinator as coord_mod
from alignrl.dist.coordinator import Coordinator
from alignrl.dist.ref_share import RefShare
from alignrl.dist.dispatch import Dispatcher
from alignrl.dist.weights_wire import encode_weights
from alignrl.dist.zmq_link import Replier, Requester

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def served(tmp_path):
    cfg = load_config(None, ["pipeline.max_staleness=0"])
    c = Coordinator(cfg, "", tmp_path)
    c.dispatcher = Dispatcher(BatchSampler(16, 4, seed=0), max_staleness=0, lease_timeout_s=60, incarnation="i")
    c.incarnation = "i"
    c.ref_share = RefShare(cfg, ref=None)  # on-policy: the sampler computes every reference row
    c.board = SimpleNamespace(version=0, frames=encode_weights([("w", torch.zeros(3))], 0))
    c.replier = Replier("127.0.0.1", 0)
    c.thread = threading.Thread(target=c._serve, daemon=True)
    c.thread.start()
    yield c
    c.stop.set()
    c.thread.join(10)
    c.replier.close()


def publish(c: Coordinator, version: int) -> None:
    """What WeightBoard.publish does on rank 0 once the update is done."""
    with c.lock:
        c.board.version, c.board.frames = version, encode_weights([("w", torch.full((3,), float(version)))], version)
        c._published(version)


def test_a_parked_request_is_answered_at_the_publish(served):
    with Requester(served.replier.addr) as req:
        first = req.request("work", {"sampler_id": "s", "incarnation": "i", "version": 0}, timeout_s=5)
        assert first.kind == "lease"  # the one lease k=0 allows
        assert first.meta["ref_groups"] == served.cfg.data.train_batch_size  # the sampler's share: all groups
        with served.lock:
            served.dispatcher.take(first.meta["lease"])  # its batch is in training
        t_publish = []
        threading.Timer(0.3, lambda: (t_publish.append(time.monotonic()), publish(served, 1))).start()
        t0 = time.monotonic()
        reply = req.request("work", {"sampler_id": "s", "incarnation": "i", "version": 0}, timeout_s=5)
        done = time.monotonic()
        assert reply.kind == "weights" and reply.meta["version"] == 1  # held until the publish, not "wait"
        assert done - t0 >= 0.25 and done - t_publish[0] < 0.1  # answered at the publish, without a poll period
        lease = req.request("work", {"sampler_id": "s", "incarnation": "i", "version": 1}, timeout_s=5)
        assert lease.kind == "lease" and lease.meta["version"] == 1 and not served.parked


def test_a_request_parked_too_long_is_answered_wait(served, monkeypatch):
    monkeypatch.setattr(coord_mod, "PARK_S", 0.2)
    with Requester(served.replier.addr) as req:
        assert req.request("work", {"sampler_id": "s", "incarnation": "i", "version": 0}, timeout_s=5).kind == "lease"
        t0 = time.monotonic()
        reply = req.request("work", {"sampler_id": "s", "incarnation": "i", "version": 0}, timeout_s=5)
        assert reply.kind == "wait" and reply.meta["retry_s"] == 0.0
        assert 0.15 <= time.monotonic() - t0 < 1.0  # the serve loop re-checks parked requests at least every 0.2 s


@pytest.mark.parametrize("finished", [True, False])
def test_only_a_finished_run_tells_samplers_it_is_over(served, finished):
    """close(finished=True) answers samplers "done" for a few seconds, and they exit; a run that stopped early
    (an error, Ctrl-C) answers nothing, so that they wait for the restarted trainer as after a kill -9."""
    from alignrl.dist.zmq_link import PeerTimeout

    served.say_done = finished
    served.stop.set()
    with Requester(served.replier.addr) as req:
        ask = {"sampler_id": "s", "incarnation": "i", "version": 0}
        if finished:
            assert req.request("work", ask, timeout_s=5).kind == "done"
        else:
            with pytest.raises(PeerTimeout):
                req.request("work", ask, timeout_s=1)
