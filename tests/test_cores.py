"""Cores follow the work (`pipeline.lend_cores`, dist/cores.py): the training thread's thread count follows
the samplers of this host that do not generate, within the cores the others leave free, checked at every
layer forward and backward; a sampler generates with the threads a lease lends it and goes back to its own."""

import pytest
import torch

from alignrl.placements.zmq import thread_lending as cores
from alignrl.placements.zmq.thread_lending import CoreLedger, ThreadLoan, borrowed, local_threads

HERE = "host-a/boot"


@pytest.fixture
def counts(monkeypatch):
    """torch.set_num_threads as a log (this process's own count is left alone)."""
    log = []
    monkeypatch.setattr(torch, "set_num_threads", log.append)
    return log


def test_only_samplers_of_this_host_count():
    here = {"threads": 2, "can_map": {"host": HERE}}
    assert local_threads(here, HERE) == 2
    for meta in ({"threads": 4, "can_map": {"host": "host-b/boot"}},  # another machine's cores are not ours
                 {"threads": 1, "can_map": None}, {"threads": "2", "can_map": {"host": HERE}}, {"can_map": {"host": HERE}}):
        assert local_threads(meta, HERE) == 0


def ask(ledger: CoreLedger, sampler: str, threads: int = 1) -> None:
    ledger.asked(sampler, {"threads": threads, "can_map": {"host": HERE}})


@pytest.mark.parametrize("k0", [True, False])
def test_the_trainer_gets_the_threads_of_samplers_that_do_not_generate(k0):
    loan = ThreadLoan(own=1, cores=2)
    ledger = CoreLedger(loan, HERE, lend_to_samplers=k0)
    ledger.update({}, 0.0)
    assert loan.want == 1  # no sampler known: its own share only
    ask(ledger, "a")
    ledger.update({}, 0.0)
    assert loan.want == 2  # a's batch is made and its request waits
    assert ledger.leased("a", "L1", 1.0) == (1 if k0 else 0)  # on policy the trainer waits for a's batch: lent
    ledger.update({"L1": object()}, 1.1)
    assert loan.want == 1
    ledger.update({}, 1.2)  # the lease ended a moment after its answer: a may be pushing its batch
    assert loan.want == 1
    ledger.update({}, 1.0 + cores.ANSWERED_S)  # ... but not for seconds without a request: a died, its core is free
    assert loan.want == 2
    ask(ledger, "b", 4)  # a second sampler here, told to run more threads than the machine has cores
    ledger.update({}, 5.0)
    assert loan.want == 2
    ledger.leased("a", "L2", 5.0)
    ledger.update({"L2": object()}, 5.0)
    assert loan.want == 1  # a generates: never more than the cores it leaves free


def test_a_sampler_works_from_its_answer_to_its_next_request(counts):
    """Answered with weights (or "wait"), a sampler maps them and asks again at once: it is not idle then. A
    publish answers every parked request, so the trainer takes back only its own share at once, in the training
    thread, before the sync thread answers them: its next layer must not run on a core the sampler takes back."""
    loan = ThreadLoan(own=1, cores=2)
    ledger = CoreLedger(loan, HERE, lend_to_samplers=False)
    ask(ledger, "a")
    ledger.update({}, 0.0)
    loan.apply()
    assert loan.want == 2 and counts == [2]  # the training thread took a's idle core
    ledger.published(1.0)
    assert loan.want == 1 and loan.now == 1 and counts == [2, 1]
    ledger.update({}, 1.0)  # the sync thread, before it has answered a's parked request
    assert loan.want == 1
    ask(ledger, "a")  # the parked request re-checked: the new weights are its answer
    ledger.answered("a", 1.0)
    ledger.update({}, 1.0)
    assert loan.want == 1
    ask(ledger, "a")  # a asks for a lease that the staleness bound holds back: parked, idle
    ledger.update({}, 1.01)
    assert loan.want == 2


def test_without_a_loan_the_ledger_does_nothing():
    ledger = CoreLedger(None, HERE, lend_to_samplers=True)
    ask(ledger, "a")
    assert ledger.leased("a", "L1", 0.0) == 0 and ledger.samplers == {}
    ledger.answered("a", 0.0)
    ledger.published(0.0)
    ledger.update({}, 0.0)


def test_the_loan_follows_want_and_settles_back(counts):
    loan = ThreadLoan(own=1, cores=2)
    loan.apply()
    assert counts == []  # its own count, already set
    loan.want = 2
    loan.apply()
    loan.apply()
    assert counts == [2] and loan.now == 2  # set once
    loan.settle()
    assert counts == [2, 1] and loan.now == 1


def test_layers_check_the_loan_in_the_forward_and_in_the_backward(counts):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ModuleList([torch.nn.Linear(4, 4)
                                                                            for _ in range(3)]))
    loan = ThreadLoan(own=1, cores=2)
    loan.install(model)
    x = model[0](torch.randn(2, 4))
    seen = []
    for i, layer in enumerate(model[1]):
        x = layer(x)
        seen.append(loan.now)
        if i == 1:
            loan.want = 2  # the sampler's batch is made during the forward of layer 1
    assert seen == [1, 1, 2] and counts == [2]
    loan.want = 1  # it gets its lease before the backward: the next layer's backward returns its core
    x.sum().backward()
    assert counts == [2, 1]
    assert all(p.grad is not None for p in model.parameters())  # the hooks leave the gradients alone


def test_a_sampler_borrows_the_lent_threads_for_one_batch(counts, monkeypatch):
    monkeypatch.setattr(cores, "machine_cores", lambda: 2)
    with borrowed(1, 1):
        assert counts == [2]
    assert counts == [2, 1]
    for own, lent in ((1, 0), (1, None), (1, "1"), (2, 1), (0, 1)):  # none lent, garbage, no free core, a GPU sampler
        with borrowed(own, lent):
            pass
    assert counts == [2, 1]
