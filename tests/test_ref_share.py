"""pipeline.ref_logprobs: the sampler computes the reference log-probs of a prefix of a batch's prompt groups,
the trainer the rest, and `balance` moves the split toward the side that waits."""

import pytest
import torch

from alignrl.rl.producer import LocalRefScorer, RolloutMaker
from alignrl.config import load_config
from alignrl.data.records import ScoredBatch, Scores
from alignrl.rl.rollout_ops import shard_groups
from alignrl.placements.zmq.coordinator import PipelineError
from alignrl.wire.records import from_wire, to_wire
from alignrl.placements.zmq.sampler import lease_of, ref_groups, weights_timeout
from alignrl.placements.zmq.ref_share import RefShare, sampler_needs_ref, trainer_needs_ref
from alignrl.wire.frames import Message, WireError
from alignrl.interfaces import SamplingParams
from alignrl.models.logprobs import ForwardLayout
from alignrl.rollout.hf_engine import HFRolloutEngine

GROUPS, N = 4, 2


def cfg(mode: str, staleness: int = 1, *extra: str):
    return load_config(None, [f"pipeline.ref_logprobs={mode}", f"pipeline.max_staleness={staleness}",
                              f"data.train_batch_size={GROUPS}", f"rollout.n={N}", "actor.ppo_mini_batch_size=2",
                              "actor.kl_loss_coef=0.01",
                              *extra])


@pytest.fixture(scope="module")
def made(tiny_model):
    """A real rollout of GROUPS prompts x N samples, and a reference scorer on the same tiny model."""
    model, tok = tiny_model
    prompts = [tok.encode(p) for p in ("1+1=", "23+4=", "7*8=", "100-1=")]
    ro = HFRolloutEngine(model, tok).generate(prompts, SamplingParams(n=N, temperature=1.0, max_new_tokens=6, seed=3))
    ref = LocalRefScorer(model, 1.0, micro_batch=3, layout=ForwardLayout(share_prompt=True, remove_padding=True))
    return ro, ref, tok


def batch_with(ro, ref_lp) -> ScoredBatch:
    b = len(ro.group)
    return ScoredBatch(ro, Scores(torch.zeros(b), torch.zeros(b, dtype=torch.bool)), ro.response_mask.clone(),
                       ref_lp, ro.group.clone())


def test_who_holds_a_reference():
    assert sampler_needs_ref(cfg("sampler")) and not trainer_needs_ref(cfg("sampler"))
    assert not sampler_needs_ref(cfg("trainer")) and trainer_needs_ref(cfg("trainer", 0))
    assert sampler_needs_ref(cfg("balance")) and trainer_needs_ref(cfg("balance", 1))
    assert not trainer_needs_ref(cfg("balance", 0))  # on-policy, the sides take turns: nothing to balance


def test_balance_moves_a_group_to_the_side_that_waited_more():
    share = RefShare(cfg("balance"), ref=None)
    assert share.groups == GROUPS  # starts as seed 004: the sampler computes it all
    share.row_s = 0.01  # one group's forward: 0.02 s, the dead band
    share.observe(trainer_wait=0.2, sampler_wait=0.0)
    assert share.groups == GROUPS - 1  # the trainer idled: it takes a group
    share.observe(trainer_wait=0.11, sampler_wait=0.1)
    assert share.groups == GROUPS - 1  # within the dead band: no move
    for _ in range(GROUPS + 2):
        share.observe(trainer_wait=0.3, sampler_wait=0.0)
    assert share.groups == 0
    share.observe(trainer_wait=0.0, sampler_wait=0.3)
    assert share.groups == 1  # the sampler idled: it takes one back
    for mode, staleness, groups in (("sampler", 1, GROUPS), ("trainer", 1, 0), ("balance", 0, GROUPS)):
        fixed = RefShare(cfg(mode, staleness), ref=None)
        fixed.observe(trainer_wait=1.0, sampler_wait=0.0)
        assert fixed.groups == groups, mode


@pytest.mark.parametrize("groups", [0, 1, 3, GROUPS])
def test_the_trainer_completes_what_the_sampler_left(made, groups):
    ro, ref, tok = made
    full = ref.logprobs(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
    maker = RolloutMaker(cfg("balance"), engine=None, rewards=None, ref=ref)
    prefix = maker.ref_logprobs(ro, groups)
    assert len(prefix) == groups * N
    meta, tensors = to_wire(batch_with(ro, prefix), tok)  # across the wire: only the prefix travels
    sent = from_wire(Message("scored_batch", meta, tensors))
    done, metrics = RefShare(cfg("balance"), ref).complete(sent)
    assert metrics["pipeline/ref_rows_trainer"] == (GROUPS - groups) * N
    # the trainer's forward over fewer rows batches them differently: equal up to float rounding
    torch.testing.assert_close(done.ref_logprobs, full, rtol=0, atol=1e-5)
    if groups in (0, GROUPS):  # one side computes every row with the same call: bit for bit
        torch.testing.assert_close(done.ref_logprobs, full, rtol=0, atol=0)


def test_each_rank_completes_its_own_share(made):
    ro, ref, _ = made
    full = ref.logprobs(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
    prefix = full[:3 * N]  # the sampler did 3 of 4 groups: rank 0's share whole, rank 1's in part
    parts = []
    for rank in (0, 1):
        share = shard_groups(batch_with(ro, prefix), rank, 2)
        assert len(share.ref_logprobs) == (2 * N if rank == 0 else N)
        parts.append(RefShare(cfg("balance"), ref).complete(share)[0].ref_logprobs)
    torch.testing.assert_close(torch.cat(parts), full, rtol=0, atol=1e-5)


def test_bad_reference_rows_get_one_line(made):
    ro, ref, tok = made
    meta, tensors = to_wire(batch_with(ro, torch.zeros(len(ro.group) + 1, ro.response_ids.shape[1])), tok)
    with pytest.raises(WireError, match=r"ref_policy_log_probs.*K <= 8"):
        from_wire(Message("scored_batch", meta, tensors))
    partial = batch_with(ro, torch.zeros(N, ro.response_ids.shape[1]))
    with pytest.raises(WireError, match="2 of 8 rows under pipeline.ref_logprobs=sampler"):
        RefShare(cfg("sampler"), ref=None).check(partial)  # on the whole batch: every rank raises
    RefShare(cfg("balance"), ref).check(partial)  # a trainer with a reference completes it
    for bad in (-1, GROUPS + 1, 2 ** 64, "3", 1.5):
        with pytest.raises(PipelineError, match="reference log-probs of .* prompt groups"):
            ref_groups({"ref_groups": bad}, GROUPS)
    assert ref_groups({}, GROUPS) is None and ref_groups({"ref_groups": 0}, GROUPS) == 0
    none_needed = RefShare(cfg("balance", 1, "actor.use_kl_loss=false"), ref=None)
    assert none_needed.complete(batch_with(ro, None))[0].ref_logprobs is None


def test_a_malformed_lease_is_one_line():
    good = {"number": 3, "rows": [1, 2], "lease": "i:3"}
    assert lease_of(Message("lease", good)) == (3, [1, 2], "i:3")
    for kind, meta in (("lease", {**good, "number": "3"}), ("lease", {**good, "rows": None}),
                       ("lease", {**good, "rows": [1.5]}), ("lease", {"number": 3, "rows": [1]}), ("surprise", good)):
        with pytest.raises(PipelineError, match=f"malformed {kind!r}: run the same alignrl version"):
            lease_of(Message(kind, meta))


def test_a_work_request_waits_long_enough_for_the_weights_it_may_bring():
    assert 5.0 < weights_timeout(3_400_000) < 5.1  # the demo model: the few seconds that find a dead trainer
    assert 250 < weights_timeout(15 * 10**9) < 300  # 7B in bf16 over a 50 MiB/s link


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_reference_sharded_over_the_trainers_ranks_completes_uneven_shares(tiny_model_dir, tmp_path):
    """Beside a sharded policy the ZeroMQ trainer's reference is sharded over its ranks, whose forwards are
    collective: a rank whose rows the sampler scored all still calls it (workers/ref_share_worker.py), so the
    other rank's forwards pair up, and each rank's rows are a whole copy's."""
    import json
    import os
    import sys
    from pathlib import Path

    from alignrl.runtime.ports import free_port
    from conftest import run_group, src_path

    env = {**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": "150", "PYTHONPATH": src_path()}
    worker = Path(__file__).parent / "workers" / "ref_share_worker.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", str(worker), "--model", str(tiny_model_dir), "--out", str(tmp_path / "r")]
    done = run_group(cmd, 180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"r.{r}.json").read_text()) for r in (0, 1)]
    # rows each rank computed, for the sampler's 3, 1, 0 and 4 groups of 4 (2 rows each; 2 groups per rank)
    assert [r["computed"] for r in ranks] == [[0, 2, 4, 0], [2, 4, 4, 0]], ranks
    assert all(r["worst"] <= 1e-5 for r in ranks), ranks
