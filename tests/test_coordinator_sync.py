"""The trainer's sync port (SyncServer) in one process, with a stand-in weight board: a work
request that the staleness bound holds back is parked and answered the moment the next publish frees a
lease, with no polling by the sampler; one parked too long is answered "wait"."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from alignrl.config import load_config
from alignrl.data.sampler import BatchSampler
from alignrl.placements.zmq import sync_server as sync_mod
from alignrl.placements.zmq.batch_receiver import BatchReceiver
from alignrl.placements.zmq.ref_share import RefShare
from alignrl.placements.zmq.sync_server import SyncServer, Welcome
from alignrl.placements.zmq.thread_lending import CoreLedger
from alignrl.placements.zmq.weight_publisher import WeightBoard
from alignrl.placements.zmq.leases import Dispatcher
from alignrl.runtime.env import SINGLE
from alignrl.wire import zmq_link
from alignrl.placements.zmq.coordinator import process_of
from alignrl.wire.zmq_link import Replier

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def served(tmp_path):
    """The parts the Coordinator wires on rank 0, the sync server's thread running."""
    cfg = load_config(None, ["pipeline.max_staleness=0"])
    c = SimpleNamespace(cfg=cfg, lock=threading.Lock())
    c.dispatcher = Dispatcher(BatchSampler(16, 4, seed=0), max_staleness=0, lease_timeout_s=60, incarnation="i")
    c.ref_share = RefShare(cfg, ref=None)  # on-policy: the sampler computes every reference row
    model = torch.nn.Linear(3, 1, bias=False)
    actor = SimpleNamespace(model=model, engine=SimpleNamespace(whole_weights=True, weight_dtypes=lambda: {
        "weight": model.weight.dtype}))
    # the board calls the server at each publish, and the server answers from the board: as in the Coordinator
    c.board = WeightBoard(actor, SINGLE, cfg.pipeline, "", c.lock, lambda version: c.server.published(version), "i")
    c.replier = Replier("127.0.0.1", 0)
    c.server = SyncServer(c.replier, c.board, c.dispatcher, c.ref_share, CoreLedger(None, "", False), c.lock,
                          Welcome("", "i"), cfg.pipeline)
    publish(c, 0)
    Requester.manifest = c.board.manifest
    c.server.start()
    yield c
    c.server.close(finished=False)  # a finished run's farewell keeps the thread 3 s; no sampler here waits for it
    c.board.close()


class Requester(zmq_link.Requester):
    """A sampler's socket: hello (with the trainer's own model manifest) before each sampler process's first work
    request, as samplers do; the sync port answers work from a sampler it did not welcome with "hello"."""
    manifest: dict = {}

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.greeted = set()

    def request(self, kind, meta, tensors=None, timeout_s=5.0):
        if kind == "work" and process_of(meta) not in self.greeted:
            self.greeted.add(process_of(meta))
            hello = {k: meta[k] for k in ("sampler_id", "proc", "can_map") if k in meta}
            assert super().request("hello", {**hello, "manifest": self.manifest}, timeout_s=timeout_s).kind == "welcome"
        return super().request(kind, meta, tensors, timeout_s=timeout_s)


def publish(c: SimpleNamespace, version: int) -> None:
    """An update, then the publish (on rank 0 of a one-process trainer)."""
    with torch.no_grad():
        c.board.actor.model.weight.fill_(float(version))
    c.board.publish(version)


def test_work_without_hello_gets_neither_weights_nor_a_lease(served):
    """A peer that skipped hello (another program, or one of another version) was never checked against the
    trainer's model and data: it is told to say hello, and learns nothing of the weights or the rows."""
    with zmq_link.Requester(served.replier.addr) as raw:
        for version in (-1, 0):
            reply = raw.request("work", {"sampler_id": "x", "incarnation": "i", "version": version}, timeout_s=5)
            assert reply.kind == "hello" and reply.meta == {"incarnation": "i"} and not reply.tensors
        assert not served.dispatcher.outstanding
    with Requester(served.replier.addr) as req:  # once it said hello, it is served
        assert req.request("work", {"sampler_id": "x", "incarnation": "i", "version": 0}, timeout_s=5).kind == "lease"


def test_a_parked_request_is_answered_at_the_publish(served, monkeypatch):
    monkeypatch.setattr(sync_mod, "POLL_S", 10.0)  # only the publish's wake-up can answer it within 5 s
    monkeypatch.setattr(sync_mod, "PARK_S", 30.0)
    with Requester(served.replier.addr) as req:
        first = req.request("work", {"sampler_id": "s", "incarnation": "i", "version": 0}, timeout_s=5)
        assert first.kind == "lease"  # the one lease k=0 allows
        assert first.meta["ref_groups"] == served.cfg.data.train_batch_size  # the sampler's share: all groups
        with served.lock:
            served.dispatcher.take(first.meta["lease"])  # its batch is in training
        t_publish = []
        threading.Timer(0.3, lambda: (t_publish.append(time.monotonic()), publish(served, 1))).start()
        reply = req.request("work", {"sampler_id": "s", "incarnation": "i", "version": 0}, timeout_s=30)
        done = time.monotonic()
        assert reply.kind == "weights" and reply.meta["version"] == 1  # held until the publish, not "wait"
        # answered at the publish, not at the next poll (10 s)
        assert t_publish and t_publish[0] <= done < t_publish[0] + 9
        lease = req.request("work", {"sampler_id": "s", "incarnation": "i", "version": 1}, timeout_s=5)
        assert lease.kind == "lease" and lease.meta["version"] == 1 and not served.server.parked


def test_a_request_parked_too_long_is_answered_wait(served, monkeypatch):
    monkeypatch.setattr(sync_mod, "PARK_S", 0.2)
    with Requester(served.replier.addr) as req:
        assert req.request("work", {"sampler_id": "s", "incarnation": "i", "version": 0}, timeout_s=5).kind == "lease"
        t0 = time.monotonic()
        reply = req.request("work", {"sampler_id": "s", "incarnation": "i", "version": 0}, timeout_s=30)
        assert reply.kind == "wait" and reply.meta["retry_s"] == 0.0  # no publish comes: the poll answers it
        assert time.monotonic() - t0 >= 0.15


def test_cores_go_to_the_side_that_works(served, monkeypatch):
    """pipeline.lend_cores on policy: each lease lends a sampler on this host the trainer's threads; while that
    sampler's next request is parked, its thread is the training thread's; a sampler elsewhere is lent none.
    Each step waits for the state it needs (parked, re-counted) instead of racing timers against PARK_S."""
    from alignrl.placements.zmq.thread_lending import CoreLedger, ThreadLoan
    from alignrl.wire.shared_weights import host_id

    monkeypatch.setattr(sync_mod, "PARK_S", 60.0)  # parked until the publish below, however slow the machine
    served.server.cores = CoreLedger(ThreadLoan(own=1, cores=2), host_id(), lend_to_samplers=True)
    here = {"sampler_id": "s", "incarnation": "i", "version": 0, "threads": 1,
            "can_map": {"shared": False, "host": host_id(), "cuda": []}}
    with Requester(served.replier.addr) as req:
        lease = req.request("work", here, timeout_s=5)
        assert lease.kind == "lease" and lease.meta["threads"] == 1
        wait_until(lambda: served.server.cores.loan.want == 1, "the sampler's thread counted as generating")
        assert served.server.cores.loan.want == 1  # the sampler generates
        with served.lock:
            served.dispatcher.take(lease.meta["lease"])  # its batch is in training
        replies, want = [], []
        asking = threading.Thread(target=lambda: replies.append(req.request("work", here, timeout_s=30)))
        asking.start()
        wait_until(lambda: served.server.parked and served.server.cores.loan.want == 2,
                   "the request parked, its core lent back")
        want.append(served.server.cores.loan.want)
        assert not replies  # still parked: nothing answers it before the publish
        publish(served, 1)
        asking.join(30)
        assert replies and replies[0].kind == "weights"
        assert want == [2]  # parked until the publish: the training thread had its core
        # the serve loop re-counts: answered with weights, the sampler loads them, busy
        wait_until(lambda: served.server.cores.loan.want == 1, "the sampler's thread counted as busy again")
        assert served.server.cores.loan.want == 1
        far = {**here, "sampler_id": "far", "version": 1, "can_map": {**here["can_map"], "host": "elsewhere/x"}}
        assert req.request("work", far, timeout_s=5).meta["threads"] == 0


def wait_until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not seen within {timeout:g} s: {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("finished", [True, False])
def test_only_a_finished_run_tells_samplers_it_is_over(served, finished):
    """close(finished=True) answers samplers "done" for a few seconds, and they exit; a run that stopped early
    (an error, Ctrl-C) answers nothing, so that they wait for the restarted trainer as after a kill -9."""
    from alignrl.wire.zmq_link import PeerTimeout

    served.server.say_done = finished
    served.server.stop.set()
    with Requester(served.replier.addr) as req:
        ask = {"sampler_id": "s", "incarnation": "i", "version": 0}
        if finished:
            assert req.request("work", ask, timeout_s=5).kind == "done"
            assert req.request("alive", ask, timeout_s=5).kind == "done"  # heard by a sampler mid-generation
        else:
            with pytest.raises(PeerTimeout):
                req.request("work", ask, timeout_s=1)
            with pytest.raises(PeerTimeout):
                req.request("alive", ask, timeout_s=1)


def test_weights_go_shared_to_a_sampler_that_can_map_them_and_as_frames_to_others(served):
    """On the trainer's host a sampler gets handles to the shared set (no tensor frames) and reads the same
    weights through them; one that says it cannot map them, or runs elsewhere, gets the frames."""
    from alignrl.wire.shared_weights import SHARED_KIND, SharedReader, host_id

    here = {"shared": True, "host": host_id(), "cuda": []}
    reader = SharedReader()
    with Requester(served.replier.addr) as req:
        # auto: version 0 was published before any sampler said how it takes weights, as frames only
        first = req.request("work", {"sampler_id": "near", "incarnation": "?", "version": -1, "can_map": here},
                            timeout_s=5)
        assert first.kind == "weights" and served.board.shared.current is None
        publish(served, 3)  # a sampler maps them now: shared sets from this publish on
        for who, can_map, kind in (("near", here, SHARED_KIND), ("far", {**here, "host": "elsewhere/x"}, "weights"),
                                   ("unable", {**here, "shared": False}, "weights"), ("old", None, "weights")):
            reply = req.request("work", {"sampler_id": who, "incarnation": "i", "version": 0, "can_map": can_map},
                                timeout_s=5)
            assert reply.kind == kind, who
            got = reader.tensors(reply) if kind == SHARED_KIND else reply.tensors
            assert not reply.tensors or kind == "weights"
            torch.testing.assert_close(got["weight"], torch.full((1, 3), 3.0), rtol=0, atol=0)
        # the one sampler that holds the shared set has it untouched by the next publish (another set is filled)
        held = reader.tensors(req.request("work", {"sampler_id": "near", "incarnation": "i", "version": 0,
                                                   "can_map": here}, timeout_s=5))
        publish(served, 4)
        assert float(held["weight"][0, 0]) == 3.0 and len(served.board.shared.sets) == 2
        # a sampler that then finds it cannot map them says so, and is sent frames from then on
        again = req.request("work", {"sampler_id": "near", "incarnation": "i", "version": 3,
                                     "can_map": {**here, "shared": False}}, timeout_s=5)
        assert again.kind == "weights" and again.meta["version"] == 4
    reader.close()


def test_two_samplers_given_one_name_keep_their_own_hold_on_a_shared_set(served):
    """Holds belong to a sampler process, not to its --sampler-id: a second process named the same asking
    again must not free the set the first one is still copying from."""
    from alignrl.wire.shared_weights import SharedReader, host_id

    here = {"shared": True, "host": host_id(), "cuda": []}
    reader = SharedReader()

    def ask(proc: str, version: int):
        return req.request("work", {"sampler_id": "s", "proc": proc, "incarnation": "i", "version": version,
                                    "can_map": here}, timeout_s=5)

    with Requester(served.replier.addr) as req:
        ask("one", -1)  # known now: shared sets from the next publish on
        publish(served, 3)
        held = reader.tensors(ask("one", 0))  # process "one" copies from the set of version 3 ...
        reader.tensors(ask("two", 0))
        assert ask("two", 3).kind == "lease"  # ... while "two" has finished its copy and works
        publish(served, 4)
        publish(served, 5)  # the set of version 3 is no longer current, but "one" still holds it
        assert float(held["weight"][0, 0]) == 3.0 and len(served.board.shared.sets) == 3
    reader.close()


def board_of(transport: str) -> WeightBoard:
    cfg = load_config(None, [f"pipeline.weight_transport={transport}"])
    model = torch.nn.Linear(3, 1, bias=False)
    actor = SimpleNamespace(model=model, engine=SimpleNamespace(whole_weights=True, weight_dtypes=lambda: {
        "weight": model.weight.dtype}))
    return WeightBoard(actor, SINGLE, cfg.pipeline, "", threading.Lock(), lambda v: None, "i")


def test_a_sampler_that_cannot_map_is_refused_when_sharing_is_required():
    board = board_of("shared")
    board.publish(0)
    try:
        problem = board.admit("far", {"shared": True, "host": "elsewhere/x", "cuda": []})
        assert "pipeline.weight_transport=shared, but this sampler runs on another host" in problem
        assert "\n" not in problem and board.admit("old", None) is not None
    finally:
        board.close()


def test_a_trainer_that_cannot_share_sends_frames_under_auto_and_stops_in_one_line_under_shared(monkeypatch):
    from alignrl.wire import shared_weights as sw
    from alignrl.wire.shared_weights import SharedUnavailable, host_id
    from alignrl.wire.frames import decode

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sw.os, "posix_fallocate", full)
    auto = board_of("auto")
    auto.admit("near", {"shared": True, "host": host_id(), "cuda": []})
    auto.publish(1)  # the shared set cannot be made: frames for everyone, the run goes on
    assert auto.shared is None and decode(auto.frames_for("near")).meta["version"] == 1
    assert not auto.stale("near", ("i", 1))
    required = board_of("shared")
    with pytest.raises(SharedUnavailable, match="/dev/shm"):
        required.publish(1)
    required.close()


def test_a_malformed_request_is_answered_in_one_line_and_the_sync_port_goes_on(served):
    with Requester(served.replier.addr) as req:
        bad = req.request("hello", {"sampler_id": "s", "manifest": {"weight": 5}}, timeout_s=5)
        assert bad.kind == "error" and "malformed 'hello' request (TypeError" in bad.meta["message"]
        assert "\n" not in bad.meta["message"]
        assert req.request("work", {"sampler_id": "s", "incarnation": "i", "version": 0}, timeout_s=5).kind == "lease"


def test_a_silent_samplers_lease_goes_to_another_while_a_beating_one_keeps_its_own(served, capsys):
    """A sampler killed mid-generation says nothing more: after pipeline.heartbeat_timeout_s its rows go to the
    next sampler, long before lease_timeout_s (60 s here), and the trainer says so in one line. One that keeps
    beating keeps its lease."""
    import dataclasses

    served.dispatcher.max_staleness = 1  # two leases may be outstanding
    # beats every 0.2 s keep "busy" ten times inside its 2 s, however the threads are scheduled
    served.server.p = dataclasses.replace(served.server.p, heartbeat_timeout_s=2.0)
    with Requester(served.replier.addr) as quiet, Requester(served.replier.addr) as busy:
        lost = quiet.request("work", {"sampler_id": "quiet", "incarnation": "i", "version": 0}, timeout_s=5)
        kept = busy.request("work", {"sampler_id": "busy", "incarnation": "i", "version": 0}, timeout_s=5)
        assert lost.kind == kept.kind == "lease"
        deadline = time.monotonic() + 30
        while True:  # heartbeats from "busy" alone, until "quiet"'s lease has expired
            assert busy.request("alive", {"sampler_id": "busy"}, timeout_s=5).kind == "ok"
            with served.lock:
                if served.dispatcher.expired:
                    break
            assert time.monotonic() < deadline, "the silent sampler's lease never expired"
            time.sleep(0.2)
        with served.lock:
            assert list(served.dispatcher.outstanding) == [kept.meta["lease"]]
            assert served.dispatcher.requeue == [(lost.meta["rows"], lost.meta["number"])]
            assert served.dispatcher.expired == 1
        again = busy.request("work", {"sampler_id": "busy", "incarnation": "i", "version": 0}, timeout_s=5)
        # the rows go again with their number, the sampling seed: the same samples as the lost lease would have had
        assert again.kind == "lease" and (again.meta["rows"], again.meta["number"]) == (lost.meta["rows"],
                                                                                         lost.meta["number"])
        assert again.meta["lease"] != lost.meta["lease"]
    said = [x for x in capsys.readouterr().out.splitlines() if "not heard from" in x]
    assert said == [f"pipeline: sampler quiet not heard from in 2 s: its 4 prompts (lease {lost.meta['lease']}) go "
                    "to the next sampler that asks"], said


def test_a_sampler_that_says_bye_hands_its_lease_on_at_once(served, capsys):
    """A sampler stopped by Ctrl-C or kill says "bye": its rows go to the next sampler now, not after
    pipeline.heartbeat_timeout_s (20 s by default; the other sampler of a run waited that long). Another
    sampler's lease stays its own."""
    served.dispatcher.max_staleness = 1
    with Requester(served.replier.addr) as leaving, Requester(served.replier.addr) as staying:
        gone = leaving.request("work", {"sampler_id": "leaving", "incarnation": "i", "version": 0}, timeout_s=5)
        kept = staying.request("work", {"sampler_id": "staying", "incarnation": "i", "version": 0}, timeout_s=5)
        assert gone.kind == kept.kind == "lease"
        assert leaving.request("bye", {"sampler_id": "leaving"}, timeout_s=5).kind == "ok"
        with served.lock:
            assert list(served.dispatcher.outstanding) == [kept.meta["lease"]]
            assert served.dispatcher.requeue == [(gone.meta["rows"], gone.meta["number"])]
    said = [x for x in capsys.readouterr().out.splitlines() if "stopped" in x]
    assert said == [f"pipeline: sampler leaving stopped: its 4 prompts (lease {gone.meta['lease']}) go to the next "
                    "sampler that asks"], said


def scored(rows: list[int], n: int, version: int = 0):
    """A scored batch of n samples of each dataset row (tiny made-up tokens), as a sampler sends it."""
    from alignrl.data.records import Rollout, ScoredBatch, Scores

    b = len(rows) * n
    ro = Rollout(torch.ones(b, 3, dtype=torch.long), torch.ones(b, 3, dtype=torch.bool),
                 torch.ones(b, 2, dtype=torch.long), torch.ones(b, 2, dtype=torch.bool), torch.zeros(b, 2),
                 torch.zeros(b, dtype=torch.bool), torch.arange(len(rows)).repeat_interleave(n))
    return ScoredBatch(ro, Scores(torch.zeros(b), torch.zeros(b, dtype=torch.bool)), ro.response_mask.clone(),
                       torch.zeros(b, 2), torch.tensor(rows).repeat_interleave(n), version, "s")


def test_a_batch_that_does_not_answer_its_lease_is_skipped_and_its_rows_are_made_again(served, capsys):
    """Checked before it counts as in training: a batch of other rows (or with a foreign field) is one line and
    its lease's rows go back in the queue; the batch that answers the re-issued lease is trained."""
    import dataclasses

    from alignrl.placements.zmq.coordinator import PipelineError
    from alignrl.wire.records import KIND, to_wire
    from alignrl.wire.zmq_link import Puller, Pusher

    tok = SimpleNamespace(pad_token_id=0, decode=lambda ids: "p", batch_decode=lambda t, **_: ["r"] * len(t))
    n = served.cfg.rollout.n
    port = BatchReceiver(Puller("127.0.0.1", 0), None, served.dispatcher, served.ref_share, served.lock,
                         SimpleNamespace(version=0), served.cfg, "")
    port.p = dataclasses.replace(port.p, peer_timeout_s=1.5)
    try:
        with Requester(served.replier.addr) as req, Pusher(port.puller.addr) as push:
            for break_it in (lambda rows: ([r + 1 for r in rows], {}), lambda rows: (rows, {"metrics": [1]})):
                lease = req.request("work", {"sampler_id": "s", "incarnation": "i", "version": 0}, timeout_s=5)
                rows, extra = break_it(lease.meta["rows"])
                meta, tensors = to_wire(scored(rows, n), tok, lease=lease.meta["lease"])
                push.send(KIND, {**meta, **extra}, tensors, timeout_s=5)
                with pytest.raises(PipelineError, match="no sampler delivered a batch for step 1"):
                    port.receive(1)
                with served.lock:
                    assert served.dispatcher.requeue == [(lease.meta["rows"], lease.meta["number"])]
                    assert not served.dispatcher.outstanding
            assert port.counters["malformed"] == 2
            said = capsys.readouterr().out
            assert "the batch does not answer its lease: it holds" in said and "metrics of type list" in said
            lease = req.request("work", {"sampler_id": "s", "incarnation": "i", "version": 0}, timeout_s=5)
            assert lease.meta["rows"] == rows  # the same rows, leased again
            meta, tensors = to_wire(scored(rows, n), tok, lease=lease.meta["lease"])
            push.send(KIND, meta, tensors, timeout_s=5)
            _, _, batch = port.receive(1)
            assert batch.prompt_index.tolist() == [r for r in rows for _ in range(n)]
            assert served.dispatcher.outstanding[lease.meta["lease"]].in_training
    finally:
        port.close()


def test_a_samplers_heartbeat_hears_that_the_run_is_over(served):
    """A sampler generating when the run ends learns it from its heartbeat (answered "ok" until then), within the
    few seconds a finished trainer keeps answering, and drops its batch instead of waiting --peer-timeout."""
    from alignrl.placements.zmq.sampler import BEAT_S, Heartbeat

    beat = Heartbeat(served.replier.addr, "", {"sampler_id": "s", "proc": "p"})
    try:
        wait_until(lambda: "s#p" in served.server.seen, "the sampler's first heartbeat")
        assert not beat.over.is_set()
        served.server.say_done = True
        served.server.stop.set()
        assert beat.over.wait(3 * BEAT_S)
    finally:
        beat.close()


def test_a_finished_run_says_done_until_each_live_sampler_has_asked(served):
    """A sampler heard from just before the run ended but not scheduled for the 3 s of the farewell (a loaded
    machine) is still told the run is over when it asks later, within a heartbeat window, instead of waiting
    --peer-timeout for a trainer that is gone; once it has asked, the sync thread ends."""
    from alignrl.placements.zmq.sampler import BEAT_S, Heartbeat

    served.server.seen["late#p"] = time.monotonic()
    served.server.say_done = True
    served.server.stop.set()
    time.sleep(3.5)
    assert served.server.thread.is_alive()  # the late sampler has not asked yet
    beat = Heartbeat(served.replier.addr, "", {"sampler_id": "late", "proc": "p"})
    try:
        assert beat.over.wait(3 * BEAT_S)
        served.server.thread.join(timeout=30)
        assert not served.server.thread.is_alive()
    finally:
        beat.close()


def test_a_sampler_told_done_as_the_run_stops_counts_as_told(served):
    """A request the stop overtook (the sync thread waiting for requests when close() stopped it, the sampler's
    answered "done" in that same pass): the sampler exits and never asks again, so it must count as told, and the
    finished run ends after its 3 s farewell instead of waiting out a heartbeat window (23 s here) for it."""
    ask = {"sampler_id": "s", "proc": "p", "incarnation": "i", "version": 0}
    with Requester(served.replier.addr) as req:
        assert req.request("alive", ask, timeout_s=5).kind == "ok"  # heard from before the end
        served.server.say_done = True
        served.server.stopped_at = time.monotonic()  # as close() stops the server (without its wake-up)
        served.server.stop.set()
        assert req.request("alive", ask, timeout_s=5).kind == "done"
    served.server.thread.join(timeout=12)
    assert not served.server.thread.is_alive()


def test_a_sampler_stopped_past_its_peer_timeout_still_waits_for_the_trainer(monkeypatch):
    """A sampler process stopped (SIGSTOP, a suspended machine) for longer than --peer-timeout: its first request
    after waking times out at once, which is no sign that the trainer is gone; the silence counts from then."""
    import threading as _threading

    from alignrl.placements.zmq import sampler as sampler_mod
    from alignrl.wire.zmq_link import Message, PeerTimeout

    clock = [0.0]
    monkeypatch.setattr(sampler_mod.time, "monotonic", lambda: clock[0])
    calls = []

    def request(kind, meta, timeout_s):
        calls.append(kind)
        if len(calls) == 1:
            clock[0] += 100.0  # stopped for 100 s in the middle of the request, with a 10 s --peer-timeout
            raise PeerTimeout("no answer")
        return Message("welcome", {})

    fake = SimpleNamespace(args=SimpleNamespace(peer_timeout=10.0), beat=SimpleNamespace(over=_threading.Event()),
                           sync=SimpleNamespace(request=request, addr="tcp://127.0.0.1:1"), id="s")
    assert sampler_mod.Sampler.ask(fake, "hello", {}).kind == "welcome" and calls == ["hello", "hello"]
    calls.clear()

    def silent(kind, meta, timeout_s):  # a trainer that is really gone: the usual one line after --peer-timeout
        clock[0] += timeout_s
        raise PeerTimeout("no answer")

    fake.sync.request = silent
    with pytest.raises(sampler_mod.PipelineError, match="no trainer answered on tcp://127.0.0.1:1 for 10 s"):
        sampler_mod.Sampler.ask(fake, "hello", {})


def test_a_sampler_says_it_waits_after_a_second_and_gives_up_at_its_peer_timeout(monkeypatch):
    """hello's first wait is short, so a sampler started before its trainer says so within a second; the later
    waits are the usual ones, and the last ends at --peer-timeout, not a whole wait after it."""
    import threading as _threading

    from alignrl.placements.zmq import sampler as sampler_mod
    from alignrl.wire.zmq_link import PeerTimeout

    clock, waits, said = [0.0], [], []
    monkeypatch.setattr(sampler_mod.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(sampler_mod.console, "print", lambda line: said.append((clock[0], line)))

    def silent(kind, meta, timeout_s):
        waits.append(timeout_s)
        clock[0] += timeout_s
        raise PeerTimeout("no answer")

    fake = SimpleNamespace(args=SimpleNamespace(peer_timeout=12.0), beat=SimpleNamespace(over=_threading.Event()),
                           sync=SimpleNamespace(request=silent, addr="tcp://127.0.0.1:1"), id="s")
    with pytest.raises(sampler_mod.PipelineError, match="no trainer answered on tcp://127.0.0.1:1 for 12 s"):
        sampler_mod.Sampler.ask(fake, "hello", {}, first_s=1.0)
    assert waits == [1.0, 5.0, 5.0, 1.0] and clock[0] == 12.0
    assert len(said) == 1 and said[0][0] == 1.0 and "waiting for a trainer on tcp://127.0.0.1:1" in said[0][1]


def test_a_sampler_that_never_met_a_trainer_stops_without_a_goodbye():
    """Ctrl-C of a sampler still waiting for its trainer: no farewell to send, and no wait for the heartbeat's
    request in flight (it had waited up to 3 s for nobody)."""
    from alignrl.placements.zmq import sampler as sampler_mod

    closed = []
    beat = SimpleNamespace(answered_at=0.0, close=lambda wait=True: closed.append(wait))
    fake = SimpleNamespace(trainer=None, beat=beat, sync=None)  # a bye request would fail on sync=None
    fake.met_a_trainer = sampler_mod.Sampler.met_a_trainer.fget(fake)
    sampler_mod.Sampler.bye(fake)
    assert closed == [False]
    beat.answered_at = 5.0
    assert sampler_mod.Sampler.met_a_trainer.fget(fake)


def test_hello_waits_a_second_first_and_a_run_that_met_no_trainer_ends_without_waiting_for_its_heartbeat():
    """The two places the sampler uses what the tests above test: hello asks with the short first wait, and a sampler
    stopped (Ctrl-C) before any trainer answered closes its heartbeat without waiting; one that met a trainer waits."""
    from alignrl.placements.zmq import sampler as sampler_mod
    from alignrl.wire.zmq_link import Message

    asked = []
    fake = SimpleNamespace(manifest={}, id="s", proc="p", can_map={}, base_weights="w",
                           ask=lambda kind, meta, **kw: asked.append((kind, kw)) or Message("error", {"message": "no"}))
    with pytest.raises(sampler_mod.PipelineError, match="trainer refused this sampler: no"):
        sampler_mod.Sampler.hello(fake)
    assert asked == [("hello", {"first_s": 1.0})]

    def stopped():
        raise KeyboardInterrupt

    for answered_at, waited in ((0.0, False), (5.0, True)):
        closed = []
        beat = SimpleNamespace(answered_at=answered_at, close=lambda wait=True, closed=closed: closed.append(wait))
        fake = SimpleNamespace(trainer=None, beat=beat, shared=SimpleNamespace(close=lambda: None), _run=stopped)
        fake.met_a_trainer = sampler_mod.Sampler.met_a_trainer.fget(fake)
        with pytest.raises(KeyboardInterrupt):
            sampler_mod.Sampler.run(fake)
        assert closed == [waited]
