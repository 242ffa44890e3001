"""DAPO pieces: overlong penalty, group filtering, rollout merging, dynamic sampling, truncation
masking, rollout importance sampling and their config checks."""

import pytest
import torch

from alignrl.rl.rollout_ops import concat_rollouts, kept_groups, mixed_reward_groups, reward_band_groups, select_groups
from alignrl.config import load_config
from alignrl.core.shaping import overlong_penalty, truncated_reward
from alignrl.data.records import Experience, Rollout

PAD = 0


def test_overlong_penalty_hand_values():
    # max_len 10, buffer 4: free up to 6 tokens, then -1/4 per token down to -1 at 10
    lengths = torch.tensor([3, 6, 7, 8, 9, 10])
    assert overlong_penalty(lengths, 10, 4).tolist() == [0.0, 0.0, -0.25, -0.5, -0.75, -1.0]
    assert overlong_penalty(lengths, 10, 4, factor=0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.375, -0.5]
    # buffer = max_len: the penalty starts at the first token
    assert overlong_penalty(torch.tensor([0, 2, 4]), 4, 4, factor=2.0).tolist() == [0.0, -1.0, -2.0]
    # past max_len the penalty stays at -factor; buffer 0 disables
    assert overlong_penalty(torch.tensor([12]), 10, 4).tolist() == [-1.0]
    assert overlong_penalty(lengths, 10, 0).tolist() == [0.0] * 6
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, 10, 11)


def test_truncated_reward_scales_or_replaces_only_cut_responses():
    """ProRL's stop-properly penalty: a coefficient >= 0 scales a cut response's reward, one < 0 replaces it."""
    rewards, cut = torch.tensor([1.0, 1.0, -0.5, 0.25]), torch.tensor([True, False, True, False])
    assert truncated_reward(rewards, cut, 0.0).tolist() == [0.0, 1.0, -0.0, 0.25]
    assert truncated_reward(rewards, cut, 0.5).tolist() == [0.5, 1.0, -0.25, 0.25]
    assert truncated_reward(rewards, cut, -0.5).tolist() == [-0.5, 1.0, -0.5, 0.25]


def test_the_reward_stage_applies_the_truncation_coefficient_after_the_overlong_penalty():
    from alignrl.data.records import Sample
    from alignrl.rl.scoring import RewardStage

    class Tok:
        pad_token_id = 0

        def batch_decode(self, ids, skip_special_tokens=True):
            return ["7"] * len(ids)

    ro = Rollout(torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.bool),
                 torch.ones(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool), torch.zeros(2, 4),
                 torch.tensor([True, False]), torch.tensor([0, 1]))
    samples = [Sample([{"role": "user", "content": "?"}], "7", "gsm8k")] * 2
    stage = RewardStage(Tok(), lambda *a: 1.0, lambda *a: 1.0, max_new_tokens=4, overlong_buffer_len=2,
                        truncated_reward_coef=-0.25)
    # both responses are 4 tokens long (the cap): the overlong penalty takes 1, then the cut one is replaced
    assert stage.score(ro, samples).rewards.tolist() == [-0.25, 0.0]
    stage.truncated_reward_coef = 0.5
    assert stage.score(ro, samples).rewards.tolist() == [0.0, 0.0]
    stage.truncated_reward_coef, stage.overlong_buffer_len = 0.5, 0
    assert stage.score(ro, samples).rewards.tolist() == [0.5, 1.0]
    assert load_config(None, ["algorithm.truncated_reward_coef=0"]).algorithm.truncated_reward_coef == 0.0


def test_mixed_reward_groups_keeps_only_groups_with_different_rewards():
    # group 0: 1,1,1 (all right)  1: 0,1,0 (mixed)  2: 0,0,0 (all wrong)  3: 0.5,0.5,0.25 (mixed, shaped)
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.25])
    group = torch.arange(4).repeat_interleave(3)
    assert mixed_reward_groups(rewards, group).tolist() == [1, 3]
    # ids need not be contiguous or start at 0
    assert mixed_reward_groups(torch.tensor([1.0, 2.0, 3.0, 3.0]), torch.tensor([5, 5, 9, 9])).tolist() == [5]


def test_reward_band_groups_keeps_means_strictly_inside():
    # means: 1.0, 1/3, 0.0, 0.5, 0.9 (shaped rewards may leave [0, 1]: group 4 is -0.2, 1, 1.9)
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, -0.2, 1.0, 1.9])
    group = torch.arange(5).repeat_interleave(3)
    assert reward_band_groups(rewards, group, 0.0, 1.0).tolist() == [1, 3, 4]  # 0 and 1 themselves are out
    assert reward_band_groups(rewards, group, 0.4, 0.95).tolist() == [3, 4]
    assert reward_band_groups(rewards, group, 0.5, 1.0).tolist() == [4]  # the bound 0.5 is out
    # ids need not be contiguous; groups may differ in size
    assert reward_band_groups(torch.tensor([0.2, 1.0, 1.0, 0.0]), torch.tensor([7, 7, 9, 9]), 0, 1).tolist() == [7, 9]


def test_a_band_at_the_rewards_range_is_dapos_rule_for_0_1_rewards():
    g = torch.arange(64).repeat_interleave(4)
    r = torch.randint(0, 2, (256,), generator=torch.Generator().manual_seed(0)).float()
    assert torch.equal(kept_groups(r, g, [0.0, 1.0]), mixed_reward_groups(r, g))
    assert torch.equal(kept_groups(r, g), mixed_reward_groups(r, g))  # no band: rewards differ
    # not so for shaped rewards: 0.5, 0.5 is kept by the band, not by DAPO's rule
    assert kept_groups(torch.tensor([0.5, 0.5]), torch.tensor([0, 0]), [0, 1]).tolist() == [0]


@pytest.mark.parametrize("keys, message", [
    (["algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_range=[1,0]"], "low < high"),
    (["algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_range=[0.5]"], "low < high"),
    (["algorithm.dynamic_sampling_range=[0,1]"], "read only with algorithm.dynamic_sampling=true")])
def test_dynamic_sampling_range_checks(keys, message):
    from alignrl.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(None, keys)


def _rollout(prompts: list[list[int]], responses: list[list[int]], truncated: list[bool], n: int) -> Rollout:
    """A Rollout built by hand: prompts left-padded, responses right-padded, log-probs -(token id)."""
    p, r = max(map(len, prompts)), max(map(len, responses))
    pid = torch.tensor([[PAD] * (p - len(x)) + x for x in prompts])
    pm = torch.tensor([[False] * (p - len(x)) + [True] * len(x) for x in prompts])
    rid = torch.tensor([x + [PAD] * (r - len(x)) for x in responses])
    rm = torch.tensor([[True] * len(x) + [False] * (r - len(x)) for x in responses])
    return Rollout(pid, pm, rid, rm, -rid.float() * rm, torch.tensor(truncated),
                   torch.arange(len(prompts) // n).repeat_interleave(n))


def _rows(ro: Rollout) -> list[tuple]:
    """Each row's real content, independent of padding width."""
    return [(ro.prompt_ids[i][ro.prompt_mask[i]].tolist(), ro.response_ids[i][ro.response_mask[i]].tolist(),
             ro.logprobs[i][ro.response_mask[i]].tolist(), bool(ro.truncated[i]), int(ro.group[i]))
            for i in range(len(ro.group))]


A = _rollout([[5, 6], [5, 6], [7], [7], [8, 9, 10], [8, 9, 10]],
             [[11], [12, 13], [14, 15, 16], [17], [18, 19], [20]], [False, False, True, False, False, True], n=2)
B = _rollout([[21, 22, 23, 24], [21, 22, 23, 24]], [[25, 26, 27, 28, 29], [30]], [True, False], n=2)


def test_select_groups_keeps_rows_exactly_and_renumbers():
    out = select_groups(A, [2, 0])
    rows = _rows(A)
    assert _rows(out) == [r[:4] + (0,) for r in rows[:2]] + [r[:4] + (1,) for r in rows[4:]]
    # widths are kept, padding stays padding
    assert out.prompt_ids.shape == (4, 3) and out.response_ids.shape == (4, 3)
    assert (out.prompt_ids[~out.prompt_mask] == PAD).all() and (out.response_ids[~out.response_mask] == PAD).all()
    assert len(select_groups(A, []).group) == 0


def test_concat_rollouts_pads_and_preserves_rows():
    out = concat_rollouts(A, B, PAD)
    assert out.prompt_ids.shape == (8, 4) and out.response_ids.shape == (8, 5)
    assert _rows(out) == _rows(A) + [r[:4] + (r[4] + 3,) for r in _rows(B)]
    # left-padded prompts: every row's last prompt token in the last column; right-padded responses
    assert out.prompt_mask[:, -1].all() and out.response_mask[:, 0].all()
    assert (out.prompt_ids[~out.prompt_mask] == PAD).all() and (out.response_ids[~out.response_mask] == PAD).all()
    assert (out.logprobs[~out.response_mask] == 0).all()
    # the concatenated batch is well formed: response tokens follow their prompt with no gap
    assert out.input_ids[0].tolist() == [PAD, PAD, 5, 6, 11, PAD, PAD, PAD, PAD]
    # merging onto an empty selection (dynamic sampling's first round kept nothing) is just B
    assert _rows(concat_rollouts(select_groups(A, []), B, PAD)) == _rows(B)


def test_experience_select_trims_is_weight():
    exp = Experience(A.prompt_ids, A.prompt_mask, A.response_ids, A.response_mask, A.logprobs, None,
                     torch.zeros(6), is_weight=torch.arange(18.0).view(6, 3))
    sub = exp.select(torch.tensor([0, 1]))  # responses of 1 and 2 tokens: one padding column is trimmed
    assert sub.is_weight.tolist() == [[0.0, 1.0], [3.0, 4.0]] and sub.response_ids.shape == (2, 2)
    assert exp.select(torch.tensor([0])).is_weight.shape == (1, 1)


def test_policy_loss_applies_is_weight():
    from alignrl.train.actor import PolicyLossSpec, policy_loss

    logp = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    base = dict(prompt_ids=torch.ones(1, 1, dtype=torch.long), prompt_mask=torch.ones(1, 1, dtype=torch.bool),
                response_ids=torch.ones(1, 3, dtype=torch.long), response_mask=mask,
                old_logprobs=torch.tensor([[-1.5, -1.5, 0.0]]), ref_logprobs=None, advantages=torch.tensor([1.0]))
    plain, _ = policy_loss(logp, None, Experience(**base), PolicyLossSpec(), 2.0, 1.0)
    weighted, _ = policy_loss(logp, None, Experience(**base, is_weight=torch.tensor([[2.0, 0.0, 0.0]])),
                              PolicyLossSpec(), 2.0, 1.0)
    # per token max(-A r, -A clip(r)), A = 1: ratio e^0.5 counts as 1.2, ratio e^-0.5 as itself
    t0, t1 = -1.2, -torch.exp(torch.tensor(-0.5)).item()
    assert plain.item() == pytest.approx((t0 + t1) / 2)
    assert weighted.item() == pytest.approx(2 * t0 / 2)


def test_defaults_change_nothing():
    a = load_config().algorithm
    assert a.dynamic_sampling_range == []
    assert (a.dynamic_sampling, a.max_gen_rounds, a.overlong_buffer_len, a.overlong_penalty_factor,
            a.mask_truncated, a.rollout_is, a.rollout_is_threshold, a.rollout_is_mode) == (
        False, 3, 0, 1.0, False, "none", 2.0, "truncate")
    load_config(None, ["algorithm.rollout_is=sequence", "algorithm.overlong_buffer_len=64"])  # valid together


# ---- producer and trainer on the tiny model --------------------------------------------------------------------

STEP = ["data.train_batch_size=4", "rollout.n=2", "rollout.max_new_tokens=6", "actor.ppo_mini_batch_size=2",
        "actor.ppo_micro_batch_size=4", "actor.lr=1e-3"]


class Harness:
    """The producer and trainer of an in-process run, fed given (samples, prompt ids) instead of a dataset."""

    def __init__(self, placed):
        self.maker, self.trainer, self.tokenizer = placed.maker, placed.trainer, placed.tokenizer
        self.engine, self.actor = self.maker.engine, self.trainer.actor

    def run(self, step, samples, prompts, more_prompts=None):
        pool_s, pool_p = list(samples), list(prompts)

        def rows(idx):
            return [pool_s[i] for i in idx], [pool_p[i] for i in idx]

        def more():
            s, p = more_prompts()
            pool_s.extend(s)
            pool_p.extend(p)
            return range(len(pool_s) - len(s), len(pool_s))

        batch = self.maker.make(step, range(len(pool_s)), rows, more=more if more_prompts else None)
        return {**batch.metrics, **self.trainer.train(step, batch)}


class Recorder:
    """Wraps the step's engine and actor to keep what was generated and what was trained on."""

    def __init__(self, step):
        self.rollouts, self.experiences = [], []
        generate, update = step.engine.generate, step.actor.update

        def gen(*a, **k):
            self.rollouts.append(generate(*a, **k))
            return self.rollouts[-1]

        def upd(exp, *a, **k):
            self.experiences.append(exp)
            return update(exp, *a, **k)

        step.engine.generate, step.actor.update = gen, upd


def _step(tiny_model_dir, extra, rewards=None):
    """The in-process producer and trainer on the tiny model; `rewards` (a list) replaces the reward
    function by those values in call order, so the test decides which groups are mixed."""
    from alignrl.placements.local import place

    step = Harness(place(load_config(None, STEP + [f"model.path={tiny_model_dir}"] + extra), str(tiny_model_dir)))
    if rewards is not None:
        it = iter(rewards)
        step.maker.rewards.reward_fn = step.maker.rewards.correct_fn = lambda *_: next(it)
    return step, Recorder(step)


def _batches(step, k):
    """k batches of 4 (samples, prompt ids), different problems each."""
    from alignrl.data import synthetic
    from alignrl.data.collate import encode_prompts

    samples = synthetic.generate("train", 4 * k, seed=3)
    prompts = encode_prompts(step.tokenizer, samples, 64)
    return [(samples[4 * i:4 * i + 4], prompts[4 * i:4 * i + 4]) for i in range(k)]


def test_dynamic_sampling_tops_up_with_mixed_groups(tiny_model_dir):
    # round 1 (4 groups × 2): mixed, equal, equal, mixed -> 2 kept
    # round 2: equal, mixed, mixed, mixed -> 3 more, 5 in all -> the earliest 4 kept
    rewards = [1, 0, 1, 1, 0, 0, 0, 1] + [0, 0, 1, 0, 0, 1, 1, 0]
    step, rec = _step(tiny_model_dir, ["algorithm.dynamic_sampling=true"], [float(r) for r in rewards])
    (samples, prompts), extra = _batches(step, 2)
    calls = []

    def more_prompts():
        calls.append(1)
        return extra

    m = step.run(1, samples, prompts, more_prompts=more_prompts)
    assert len(calls) == 1 and m["dapo/gen_rounds"] == 2 and m["dapo/kept_groups"] == 4
    assert m["reward/mean"] == 0.5  # metrics describe the first batch as drawn
    first, second = rec.rollouts
    tokens = lambda rows: [r[:2] for r in rows]  # noqa: E731  (prompt, response) of each row
    (exp,) = rec.experiences
    trained = [(exp.prompt_ids[i][exp.prompt_mask[i]].tolist(), exp.response_ids[i][exp.response_mask[i]].tolist())
               for i in range(len(exp))]
    assert trained == tokens(_rows(select_groups(first, [0, 3]))) + tokens(_rows(select_groups(second, [1, 2])))
    # every group that reached the update has a nonzero advantage
    assert (exp.advantages.view(4, 2).abs().sum(-1) > 0).all() and exp.is_weight is None


class OtherRank:
    """A second rank as this rank sees it through the agreement: short for `short_rounds` more rounds, and keeping
    `kept` groups."""

    ranks = 2

    def __init__(self, short_rounds: int, kept: int):
        self.short_rounds, self.kept = short_rounds, kept

    def any(self, flag: bool) -> bool:
        self.short_rounds -= 1
        return flag or self.short_rounds >= 0

    def fewest(self, n: int) -> int:
        return min(n, self.kept)


def test_dynamic_sampling_over_ranks_draws_while_any_is_short_and_keeps_the_fewest(tiny_model_dir):
    # this rank's share is 2 of the 4 groups; its first draw keeps 2 (mixed, equal, equal, mixed): full at once
    step, rec = _step(tiny_model_dir, ["algorithm.dynamic_sampling=true"], [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    (samples, prompts), extra = _batches(step, 2)
    pool = list(samples) + list(extra[0])
    prompt_pool = list(prompts) + list(extra[1])
    rows = lambda idx: ([pool[i] for i in idx], [prompt_pool[i] for i in idx])  # noqa: E731
    draws = []

    def more():
        draws.append(1)
        return range(4, 8)

    # the other rank is short for two rounds and keeps one group: this rank draws twice without generating, and
    # trains one group
    batch = step.maker.make(1, range(4), rows, more=more, agree=OtherRank(short_rounds=2, kept=1))
    assert len(draws) == 2 and len(rec.rollouts) == 1
    assert batch.metrics["dapo/gen_rounds"] == 3 and batch.metrics["dapo/kept_groups"] == 2  # 1 a rank, 2 ranks
    assert batch.rollout.group.tolist() == [0, 0] and batch.prompt_index.tolist() == [0, 0]


def test_dynamic_sampling_is_bounded_and_may_train_on_nothing(tiny_model_dir):
    step, rec = _step(tiny_model_dir, ["algorithm.dynamic_sampling=true", "algorithm.max_gen_rounds=2"],
                      [1.0] * 64)
    batches = _batches(step, 4)
    pool = iter(batches[1:])
    before = [p.detach().clone() for p in step.actor.model.parameters()]
    m = step.run(1, *batches[0], more_prompts=lambda: next(pool))
    assert m["dapo/gen_rounds"] == 3 and m["dapo/kept_groups"] == 0 and len(rec.rollouts) == 3
    assert rec.experiences == [] and "actor/lr" not in m and m["reward/mean"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, step.actor.model.parameters()))


def test_dynamic_sampling_without_more_prompts_filters_only(tiny_model_dir):
    step, rec = _step(tiny_model_dir, ["algorithm.dynamic_sampling=true"], [1.0, 0.0] + [1.0] * 6)
    m = step.run(1, *_batches(step, 1)[0])
    assert m["dapo/gen_rounds"] == 1 and m["dapo/kept_groups"] == 1 and len(rec.experiences[0]) == 2


def test_dynamic_sampling_range_keeps_groups_by_mean_reward(tiny_model_dir):
    # groups' means: 0.5 (kept), 1.0, 0.75 (kept), 0.25 (out of [0.3, 0.9]); no more prompts: filter only
    rewards = [1.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.0]
    step, rec = _step(tiny_model_dir, ["algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_range=[0.3,0.9]"],
                      rewards)
    m = step.run(1, *_batches(step, 1)[0])
    assert m["dapo/kept_groups"] == 2
    (exp,) = rec.experiences
    kept = [r[:2] for r in _rows(select_groups(rec.rollouts[0], [0, 2]))]
    assert [(exp.prompt_ids[i][exp.prompt_mask[i]].tolist(), exp.response_ids[i][exp.response_mask[i]].tolist())
            for i in range(len(exp))] == kept


def test_defaults_ignore_more_prompts(tiny_model_dir):
    step, rec = _step(tiny_model_dir, [])
    m = step.run(1, *_batches(step, 1)[0], more_prompts=lambda: pytest.fail("called without dynamic sampling"))
    assert not any(k.startswith(("dapo/", "rollout/is_")) for k in m)
    (exp,) = rec.experiences
    assert exp.is_weight is None and torch.equal(exp.response_mask, rec.rollouts[0].response_mask)


def test_overlong_penalty_enters_the_reward(tiny_model_dir):
    step, rec = _step(tiny_model_dir, ["algorithm.overlong_buffer_len=6", "algorithm.overlong_penalty_factor=0.5"],
                      [1.0] * 8)
    m = step.run(1, *_batches(step, 1)[0])
    lengths = rec.rollouts[0].response_lengths.float()
    assert m["reward/mean"] == pytest.approx(float((1.0 - 0.5 * lengths / 6).mean()))
    assert m["reward/accuracy"] == 1.0  # correctness is not shaped


def test_mask_truncated_zeroes_the_loss_mask_only(tiny_model_dir):
    step, rec = _step(tiny_model_dir, ["algorithm.mask_truncated=true", "rollout.max_new_tokens=3"])
    m = step.run(1, *_batches(step, 1)[0])
    ro, (exp,) = rec.rollouts[0], rec.experiences
    assert ro.truncated.any(), "the tiny model should run into a 3-token limit"
    assert not exp.response_mask[ro.truncated].any()
    assert torch.equal(exp.response_mask[~ro.truncated], ro.response_mask[~ro.truncated])
    assert m["response/truncated_frac"] == float(ro.truncated.float().mean())  # still counted in metrics


@pytest.mark.parametrize("level, mode", [("token", "truncate"), ("sequence", "mask")])
def test_rollout_is_weights_reach_the_loss(tiny_model_dir, level, mode):
    step, rec = _step(tiny_model_dir, [f"algorithm.rollout_is={level}", f"algorithm.rollout_is_mode={mode}",
                                       "algorithm.rollout_is_threshold=1.5"])
    m = step.run(1, *_batches(step, 1)[0])
    (exp,) = rec.experiences
    w = exp.is_weight
    assert w.shape == exp.response_mask.shape and (w[~exp.response_mask] == 0).all() and (w <= 1.5).all()
    # the engine and the trainer are the same fp32 model here: the weights are 1 up to rounding
    torch.testing.assert_close(w[exp.response_mask], torch.ones(int(exp.response_mask.sum())), atol=1e-3, rtol=0)
    key = "rollout/is_truncated_frac" if mode == "truncate" else "rollout/is_masked_frac"
    assert m["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-3) and m[key] == 0.0
    if level == "sequence":  # one weight per sequence, shared by its tokens
        for row, mask in zip(w, exp.response_mask):
            assert (row[mask] == row[mask][0]).all()


@pytest.mark.parametrize("mode, per_token", [("token-mean", 1 / 3), ("seq-mean-token-sum", 1 / 2),
                                             ("seq-mean-token-mean", None)])
def test_the_kl_term_is_aggregated_like_the_policy_loss(mode, per_token):
    """verl's agg_loss and TRL's per-token loss aggregate the KL term with the loss mode, so kl_loss_coef keeps
    its meaning beside the policy term: here the gradient of k1 = logp - ref alone (zero advantages)."""
    from alignrl.train.actor import PolicyLossSpec, policy_loss

    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    exp = Experience(torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.bool),
                     torch.ones(2, 2, dtype=torch.long), mask, logp.detach().clone(), torch.zeros(2, 2),
                     torch.zeros(2))
    loss, metrics = policy_loss(logp, None, exp, PolicyLossSpec(kl_coef=1.0, kl_type="k1", loss_agg=mode), 3.0, 2.0)
    loss.backward()
    want = (torch.tensor([[1 / 4, 1 / 4], [1 / 2, 0.0]]) if per_token is None  # each row's mean, then over rows
            else mask.float() * per_token)
    torch.testing.assert_close(logp.grad, want)
    assert metrics["actor/kl_loss"] == pytest.approx((-1 - 2 - 0.5) / 3)  # the token mean, whatever the mode


def test_reward_clip_clamps_remaxs_baseline_with_the_rewards():
    # rewards [3, 3, -0.5] with greedy rewards [3, 3, -0.5] are each at their baseline: ReMax's advantage is 0,
    # not the clamped 1 minus an unclamped 3
    from alignrl.core.advantages import remax_advantages
    from alignrl.core.shaping import clip_outcome

    r = torch.tensor([3.0, 3.0, -0.5])
    out, base = clip_outcome(r, r.clone(), [-1.0, 1.0])
    assert torch.equal(out, torch.tensor([1.0, 1.0, -0.5])) and torch.equal(base, out)
    tok = torch.zeros(3, 2)
    tok[:, -1] = out
    assert torch.equal(remax_advantages(tok, torch.ones(3, 2), base), torch.zeros(3, 2))
    assert clip_outcome(r, None, [-1.0, 1.0])[1] is None and clip_outcome(r, None, [])[0] is r


def _scored(rewards_by_group: list[list[float]], first_index: int):
    """A ScoredBatch of len(rewards_by_group) groups of 2 rows, already filtered as an engine filters its share."""
    from alignrl.data.records import ScoredBatch, Scores

    n = len(rewards_by_group)
    group = torch.arange(n).repeat_interleave(2)
    ro = Rollout(torch.ones(2 * n, 1, dtype=torch.long), torch.ones(2 * n, 1, dtype=torch.bool),
                 torch.ones(2 * n, 2, dtype=torch.long), torch.ones(2 * n, 2, dtype=torch.bool), torch.zeros(2 * n, 2),
                 torch.zeros(2 * n, dtype=torch.bool), group)
    rewards = torch.tensor([float(r) for g in rewards_by_group for r in g])
    return ScoredBatch(ro, Scores(rewards, rewards >= 1), torch.ones(2 * n, 2, dtype=torch.bool), None,
                       first_index + group, 0, metrics={"reward/mean": float(rewards.mean()) if n else 0.0})


def test_the_ray_source_refills_together_and_trains_an_equal_share_on_each_rank():
    """Every rank of a Ray actor group holds the same merged batch and sampler, so each draws the same extra rounds;
    the kept groups are cut to the step's batch, then to a multiple of the ranks (shard_groups)."""
    from types import SimpleNamespace

    from alignrl.placements.ray.channel import RaySource
    from alignrl.rl.rollout_ops import shard_groups

    cfg = load_config(None, ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "algorithm.dynamic_sampling=true",
                             "algorithm.max_gen_rounds=2"])
    draws = iter([[4, 5, 6, 7], [8, 9, 10, 11]])
    kept_by_draw = {4: [[0, 1]], 8: [[1, 0], [0, 1], [1, 1]]}  # one group kept, then three (the engines' filters)
    source = object.__new__(RaySource)
    source.trainer, source.env, source.pad_id = SimpleNamespace(cfg=cfg), SimpleNamespace(rank=0, world_size=2), 0
    source.sampler = SimpleNamespace(next=lambda: next(draws))
    source.made = lambda step, index: _scored(kept_by_draw[index[0]], index[0])
    batch = source.refilled(1, _scored([[1, 0]], 0))  # the first draw kept one group of four
    assert batch.metrics == {"reward/mean": 0.5, "dapo/kept_groups": 4.0, "dapo/gen_rounds": 3.0}
    assert batch.prompt_index.tolist() == [0, 0, 4, 4, 8, 8, 9, 9]  # the earliest four groups
    assert [shard_groups(batch, r, 2).prompt_index.tolist() for r in (0, 1)] == [[0, 0, 4, 4], [8, 8, 9, 9]]
    draws = iter([[4, 5, 6, 7], [8, 9, 10, 11]])
    source.sampler = SimpleNamespace(next=lambda: next(draws))
    kept_by_draw = {4: [], 8: [[0, 1], [1, 0]]}  # still short after both rounds: 3 groups, 2 of them trained
    batch = source.refilled(1, _scored([[1, 0]], 0))
    assert batch.metrics["dapo/kept_groups"] == 2.0 and batch.metrics["dapo/gen_rounds"] == 3.0
    assert [len(shard_groups(batch, r, 2).prompt_index) for r in (0, 1)] == [2, 2]


def test_an_openrlhf_reward_files_scores_are_what_dynamic_filtering_tests(tmp_path):
    """OpenRLHF's reward_func may return "scores" beside "rewards": the rewards train, the scores decide which groups
    dynamic filtering keeps (as OpenRLHF's filter reads them); a file without them filters on the rewards."""
    from types import SimpleNamespace

    from alignrl.rewards.registry import ScoreError, load_reward_fn
    from alignrl.rl.scoring import for_filtering, rule_scores
    from alignrl.data.records import Sample

    path = tmp_path / "reward.py"  # shaped rewards that differ by length; the scores say every answer is wrong
    path.write_text("import torch\n\ndef reward_func(queries, prompts, labels):\n"
                    "    return {'rewards': torch.tensor([0.1 * len(queries[0])]), 'scores': torch.tensor([0.0]),\n"
                    "            'extra_logs': {}}\n")
    rows = [Sample([{"role": "user", "content": "q"}], "1")] * 4
    rewards = rule_scores(load_reward_fn(f"openrlhf:{path}"), "reward function", rows, ["a", "bb", "c", "dd"],
                          ["p"] * 4)
    assert [round(r, 6) for r in rewards] == [0.2, 0.3, 0.2, 0.3]  # the query is prompt + response
    filters = for_filtering(SimpleNamespace(stats={}), rewards)
    group = torch.tensor([0, 0, 1, 1])
    assert kept_groups(torch.tensor(rewards), group, (0.0, 1.0)).tolist() == [0, 1]  # the rewards would keep both
    assert filters.tolist() == [0.0] * 4 and kept_groups(filters, group, (0.0, 1.0)).tolist() == []
    assert for_filtering(SimpleNamespace(stats={}), [0.2, 1.0]) is None  # no scores: the rewards are tested
    path.write_text("def reward_func(queries, prompts, labels):\n    return {'rewards': [1.0], 'scores': [float('nan')]}\n")
    with pytest.raises(ScoreError, match="returned nan"):
        rule_scores(load_reward_fn(f"openrlhf:{path}"), "reward function", rows[:1], ["a"], ["p"])
