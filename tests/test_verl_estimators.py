"""verl's opo, grpo_passk, rloo_vectorized, grpo_vectorized and its two optimal token baselines against plain-loop
transcriptions of verl's functions (verl/trainer/ppo/core_algos.py, verl/utils group_mean_std), through the table the RL
loop reads; OPO beside rollout rejection, whose lengths count the kept tokens as verl's; the sums of squared
probabilities the optimal token baselines read, from the trainer's forward; and a step of the RL loop with each."""

import json
import math
from collections import defaultdict

import pytest
import torch
from safetensors.torch import load_file

from alignrl.config import ConfigError, load_config
from alignrl.core.advantages import ADVANTAGES, OutcomeInputs, gae_advantages
from alignrl.models.logprobs import ForwardLayout
from smallrun import overrides, weights

NEW = ("opo", "grpo_passk", "rloo_vectorized", "grpo_vectorized")
TOKEN_BASELINES = ("optimal_token_baseline", "tir_optimal_token_baseline")


# ---- verl's functions, transcribed with Python loops over rows and groups --------------------------------------

def verl_opo(token_level_rewards, response_mask, index):
    response_length = response_mask.sum(dim=-1)
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2len, id2bsl = defaultdict(list), defaultdict(list), {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
        id2len[index[i]].append(response_length[i])
    for idx in id2score:
        if len(id2score[idx]) == 1:
            id2bsl[idx] = torch.tensor(0.0)
        else:
            score_tensor, len_tensor = torch.stack(id2score[idx]), torch.stack(id2len[idx])
            id2bsl[idx] = (len_tensor * score_tensor).sum() / len_tensor.sum()
    for i in range(scores.shape[0]):
        scores[i] = scores[i] - id2bsl[index[i]]
    return scores.unsqueeze(-1) * response_mask


def verl_grpo_passk(token_level_rewards, response_mask, index, norm_adv_by_std_in_grpo, epsilon=1e-6):
    scores = token_level_rewards.sum(dim=-1)
    advantages = torch.zeros_like(scores)
    id2scores, id2indices = defaultdict(list), defaultdict(list)
    for i in range(scores.shape[0]):
        id2scores[index[i]].append(scores[i])
        id2indices[index[i]].append(i)
    for idx in id2scores:
        rewards = torch.stack(id2scores[idx])
        if rewards.numel() < 2:
            raise ValueError(f"Pass@k requires at least 2 samples per group. Got {rewards.numel()}")
        topk, topk_idx = torch.topk(rewards, 2)
        advantage = topk[0] - topk[1]
        if norm_adv_by_std_in_grpo:
            advantage = advantage / (torch.std(rewards) + epsilon)
        advantages[id2indices[idx][topk_idx[0].item()]] = advantage
    return advantages.unsqueeze(-1) * response_mask


def verl_rloo(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean = defaultdict(list), {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx in id2score:
        id2mean[idx] = torch.tensor(0.0) if len(id2score[idx]) == 1 else torch.mean(torch.stack(id2score[idx]))
    for i in range(scores.shape[0]):
        n = len(id2score[index[i]])
        if n > 1:
            scores[i] = scores[i] * n / (n - 1) - id2mean[index[i]] * n / (n - 1)
    return scores.unsqueeze(-1) * response_mask


def verl_rloo_vectorized(token_level_rewards, response_mask, index):
    """(c * r - group sum) / max(c - 1, 1), times (c > 1), row by row."""
    scores = token_level_rewards.sum(dim=-1)
    out = torch.zeros_like(scores)
    for i in range(scores.shape[0]):
        rows = [j for j in range(scores.shape[0]) if index[j] == index[i]]
        c = float(len(rows))
        total = sum(float(scores[j]) for j in rows)
        out[i] = (c * float(scores[i]) - total) / max(c - 1, 1) * (c > 1)
    return out.unsqueeze(-1) * response_mask


def verl_grpo(token_level_rewards, response_mask, index, norm_adv_by_std_in_grpo=True, epsilon=1e-6):
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx in id2score:
        if len(id2score[idx]) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            id2mean[idx], id2std[idx] = torch.mean(torch.stack(id2score[idx])), torch.std(torch.stack(id2score[idx]))
    for i in range(scores.shape[0]):
        centred = scores[i] - id2mean[index[i]]
        scores[i] = centred / (id2std[index[i]] + epsilon) if norm_adv_by_std_in_grpo else centred
    return scores.unsqueeze(-1) * response_mask


def verl_grpo_vectorized(token_level_rewards, response_mask, index, epsilon=1e-6):
    """group_mean_std(eps=0) per group from its sums, a group of one mean 0 and std 1; verl's trainer calls it without
    norm_adv_by_std_in_grpo (its compute_advantage passes the flag to grpo alone), so it always divides."""
    scores = token_level_rewards.sum(dim=-1).float()
    out = torch.zeros_like(scores)
    for i in range(scores.shape[0]):
        group = [float(scores[j]) for j in range(scores.shape[0]) if index[j] == index[i]]
        c, s1, s2 = float(len(group)), sum(group), sum(v * v for v in group)
        mean, std = s1 / c, math.sqrt(max((s2 - s1 * s1 / c) / max(c - 1, 1), 0.0))
        if c <= 1:
            mean, std = 0.0, 1.0
        out[i] = (float(scores[i]) - mean) / (std + epsilon)
    return out.unsqueeze(-1) * response_mask


# ---- random batches: groups of one to five in shuffled order, ragged masks, tied or continuous rewards ---------

def random_batch(seed: int, tied: bool, min_group: int = 1):
    gen = torch.Generator().manual_seed(seed)
    sizes = [int(torch.randint(min_group, 6, (1,), generator=gen)) for _ in range(6)]
    group = torch.tensor([g for g, n in enumerate(sizes) for _ in range(n)])
    group = group[torch.randperm(len(group), generator=gen)]
    b, t = len(group), 7
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    outcome = (torch.randint(0, 3, (b,), generator=gen) / 2.0 if tied else torch.randn(b, generator=gen)).float()
    last = torch.nn.functional.one_hot(lengths - 1, t).float()
    # untied: a per-token penalty on every generated token too, as the KL in the reward puts (the sequence reward
    # is the sum); tied: the outcome alone, so that equal rewards stay equal
    noise = torch.zeros(b, t) if tied else 0.05 * torch.randn(b, t, generator=gen) * mask
    token_rewards = outcome[:, None] * last + noise
    return token_rewards, mask, group


def ours(name: str, token_rewards, mask, group, norm_by_std: bool = True) -> torch.Tensor:
    """The advantages the RL loop takes from the table, per token as it trains on them."""
    adv = ADVANTAGES[name](OutcomeInputs(token_rewards.sum(-1), token_rewards, mask, group, norm_by_std=norm_by_std))
    return adv[:, None] * mask if adv.dim() == 1 else adv


CASES = [(seed, tied) for seed in range(6) for tied in (False, True)]


@pytest.mark.parametrize(("seed", "tied"), CASES)
def test_opo_is_verls(seed, tied):
    token_rewards, mask, group = random_batch(seed, tied)
    expected = verl_opo(token_rewards.clone(), mask, group.tolist())
    torch.testing.assert_close(ours("opo", token_rewards, mask, group), expected, rtol=1e-5, atol=1e-6)


def test_opo_weights_the_baseline_by_length():
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]).float()
    token_rewards = torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0.0], [0, 5.0, 0, 0]])
    adv = ours("opo", token_rewards, mask, torch.tensor([0, 0, 1]))[:, 0]
    assert adv.tolist() == pytest.approx([1.0 - 1.0 / 5.0, -1.0 / 5.0, 5.0])  # (1*1 + 4*0) / 5; alone: its reward


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize(("seed", "tied"), CASES)
def test_grpo_passk_is_verls(seed, tied, norm):
    token_rewards, mask, group = random_batch(seed, tied, min_group=2)
    expected = verl_grpo_passk(token_rewards.clone(), mask, group.tolist(), norm)
    got = ours("grpo_passk", token_rewards, mask, group, norm_by_std=norm)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert int((got.abs().sum(-1) > 0).sum()) <= int(group.max()) + 1  # one learner per group at most


def test_grpo_passk_ties_and_groups_of_one():
    mask = torch.ones(5, 1)
    adv = ours("grpo_passk", torch.tensor([[1.0], [1.0], [0.0], [2.0], [0.5]]), mask, torch.tensor([0, 0, 0, 1, 1]),
               norm_by_std=False)
    assert adv[:, 0].tolist() == [0.0, 0.0, 0.0, 1.5, 0.0]  # a tie at the top teaches nothing; else best - second
    with pytest.raises(ValueError, match="grpo_passk needs two samples or more of each prompt; group 1 has 1"):
        ours("grpo_passk", torch.ones(3, 1), torch.ones(3, 1), torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError):  # as verl's
        verl_grpo_passk(torch.ones(3, 1), torch.ones(3, 1), [0, 0, 1], True)


@pytest.mark.parametrize(("seed", "tied"), CASES)
def test_rloo_vectorized_is_verls_and_alignrls_rloo(seed, tied):
    assert ADVANTAGES["rloo_vectorized"] is ADVANTAGES["rloo"]
    token_rewards, mask, group = random_batch(seed, tied)
    expected = verl_rloo_vectorized(token_rewards.clone(), mask, group.tolist())
    torch.testing.assert_close(ours("rloo_vectorized", token_rewards, mask, group), expected, rtol=1e-5, atol=1e-5)
    # verl's loop rloo agrees on every group of two or more; a group of one keeps its reward there
    count = torch.bincount(group)[group]
    loop = verl_rloo(token_rewards.clone(), mask, group.tolist())
    torch.testing.assert_close(loop[count > 1], expected[count > 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize(("seed", "tied"), CASES)
def test_grpo_vectorized_is_verls_and_alignrls_grpo_with_the_std(seed, tied, norm):
    token_rewards, mask, group = random_batch(seed, tied)
    vectorized = verl_grpo_vectorized(token_rewards.clone(), mask, group.tolist())
    # verl's two forms give the same numbers, groups of one included
    torch.testing.assert_close(verl_grpo(token_rewards.clone(), mask, group.tolist()), vectorized)
    count = torch.bincount(group)[group]
    # norm_adv_by_std_in_grpo=False changes nothing, as in verl: its trainer never hands the flag to grpo_vectorized
    got = ours("grpo_vectorized", token_rewards, mask, group, norm_by_std=norm)
    torch.testing.assert_close(got[count > 1], vectorized[count > 1])
    torch.testing.assert_close(got, ours("grpo", token_rewards, mask, group, norm_by_std=True))
    # a group of one: 0 here, r / (1 + eps) in verl (rollout.n >= 2 keeps such groups out of the loop)
    assert got[count == 1].abs().sum() == 0
    if not norm:  # the group stds are not all 1: dividing or not differs somewhere
        assert not torch.allclose(got, ours("grpo", token_rewards, mask, group, norm_by_std=False))


# ---- config: the checks and the refusals ----------------------------------------------------------------------

@pytest.mark.parametrize("name", TOKEN_BASELINES)
def test_optimal_token_baselines_are_accepted_as_verl_takes_them(name):
    """No rollout.n check (alone, a response keeps its reward-to-go, as in verl); no critic; token-level advantages,
    which a sequence-level policy loss cannot weigh."""
    assert load_config(None, [f"algorithm.adv_estimator={name}", "rollout.n=1"]).algorithm.adv_estimator == name
    for extra, says in ((["critic.enable=true"], "critic.enable=true is only used by algorithm.adv_estimator=gae"),
                        (["actor.policy_loss=seq_ppo_clip"], f"adv_estimator={name} gives each token its own")):
        with pytest.raises(ConfigError, match=says):
            load_config(None, [f"algorithm.adv_estimator={name}", *extra])


def test_a_verl_line_asking_for_the_sum_of_squared_probabilities_applies_it_and_the_new_estimators_take_seq_ppo():
    """verl's switch for the optimal token baselines' actor output, as a verl script sets it beside them: applied,
    no note; False beside them is refused in one line (verl's trainer stops on it); beside another estimator verl
    computes it for metrics alone: listed as not applied. Every sequence-level new estimator takes seq_ppo_clip."""
    from alignrl.config.verl_keys import translate

    key = "actor_rollout_ref.actor.calculate_sum_pi_squared"
    for name in TOKEN_BASELINES:
        line = [f"{key}=True", f"algorithm.adv_estimator={name}"]
        assert translate(line).notes == [] and load_config(None, line).algorithm.adv_estimator == name
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"algorithm.adv_estimator={name}", f"{key}=False"])
        assert "\n" not in str(err.value) and str(err.value).startswith(
            f"{key}=False: algorithm.adv_estimator={name} reads each token's sum of squared probabilities")
    notes = translate([f"{key}=True", "algorithm.adv_estimator=grpo"]).notes
    assert notes == [f"{key}=True is accepted but not applied: alignrl computes the per-token sum of squared "
                     "probabilities for the optimal token baselines alone: verl's variance-proxy metrics are not "
                     "logged"], notes
    for name in ("opo", "grpo_passk", "rloo_vectorized", "grpo_vectorized"):
        cfg = load_config(None, [f"algorithm.adv_estimator={name}", "actor.policy_loss=seq_ppo_clip", f"{key}=False"])
        assert cfg.algorithm.adv_estimator == name


@pytest.mark.parametrize("name", ["grpo_passk", "rloo_vectorized", "grpo_vectorized"])
def test_group_estimators_need_two_samples(name):
    with pytest.raises(ConfigError, match=f"adv_estimator={name} compares the samples of each prompt: rollout.n=1"):
        load_config(None, [f"algorithm.adv_estimator={name}", "rollout.n=1"])


def test_opo_alone_keeps_its_reward_and_is_accepted_with_one_sample():
    assert load_config(None, ["algorithm.adv_estimator=opo", "rollout.n=1"]).algorithm.adv_estimator == "opo"


def test_grpo_vectorized_takes_the_flag_verl_ignores_and_says_so_once(capsys, monkeypatch):
    from alignrl.config.verl_keys import translate

    monkeypatch.setenv("ALIGNRL_VERL_KEYS_LISTED", "")  # unset for this launch, restored after
    line = ["algorithm.adv_estimator=grpo_vectorized", "algorithm.norm_adv_by_std_in_grpo=false"]
    assert not load_config(None, line).algorithm.norm_adv_by_std_in_grpo
    said = capsys.readouterr().err
    assert said.count("norm_adv_by_std_in_grpo") == 1, said
    assert ("alignrl: algorithm.norm_adv_by_std_in_grpo=False is not applied to algorithm.adv_estimator="
            "grpo_vectorized, as in verl (whose trainer passes it to grpo alone): the advantages are divided by the "
            "group std; for Dr.GRPO use algorithm.adv_estimator=grpo") in said
    for quiet in (["algorithm.adv_estimator=grpo_vectorized"], ["algorithm.adv_estimator=grpo",
                                                                 "algorithm.norm_adv_by_std_in_grpo=false"],
                  [*line, "algorithm.norm_adv_by_std_in_grpo=true"]):
        assert translate(quiet).notes == [], quiet
    assert not load_config(None, ["algorithm.adv_estimator=grpo_passk",
                                  "algorithm.norm_adv_by_std_in_grpo=false"]).algorithm.norm_adv_by_std_in_grpo


# ---- a step of the RL loop ------------------------------------------------------------------------------------

SPREAD_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return (sum(map(ord, solution_str)) % 7) / 7.0
'''


def _one_step(estimator: str, extra: list[str], tiny_model_dir, tmp_path) -> dict:
    """One RL step with `estimator` on the tiny model; its metrics row, checked to carry a signal that moved weights."""
    reward = tmp_path / "spread.py"
    reward.write_text(SPREAD_REWARD)  # the tiny model scores 0 on the built-in task: a reward that differs per answer
    cfg = load_config(None, overrides(tiny_model_dir, tmp_path, estimator, 1, 1)
                      + [f"algorithm.adv_estimator={estimator}", f"algorithm.reward_fn={reward}:compute_score", *extra])
    assert cfg.algorithm.adv_estimator == estimator
    from alignrl.runner import train_grpo

    assert train_grpo(cfg)["steps"] == 1
    row = [json.loads(x) for x in (tmp_path / estimator / "logs" / "metrics.jsonl").read_text().splitlines()][1]
    assert all(math.isfinite(v) for v in row.values() if isinstance(v, float))
    assert row["reward/std"] > 0 and row["actor/grad_norm"] > 1e-3  # the advantages carry a signal
    before, after = load_file(tiny_model_dir / "model.safetensors"), weights(tmp_path / estimator, 1)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    return row


@pytest.mark.parametrize("estimator", NEW + TOKEN_BASELINES)
def test_the_rl_loop_trains_with_each(estimator, tiny_model_dir, tmp_path):
    _one_step(estimator, [], tiny_model_dir, tmp_path)


@pytest.mark.parametrize("seed", range(8))
def test_opo_beside_rejection_weighs_the_kept_tokens_as_verls(seed):
    """verl rejects before its estimator: OPO's lengths are those of the response mask rejection leaves. Here the
    rejection is decided ahead of the advantages too, and `estimator_mask` hands the estimators the mask less what it took out."""
    from alignrl.rl.trainer import estimator_mask

    token_rewards, mask, group = random_batch(seed, tied=False)
    gen = torch.Generator().manual_seed(100 + seed)
    given = mask.bool()
    kept = given & (torch.rand(mask.shape, generator=gen) > 0.3)  # token rejection
    kept[torch.rand(len(mask), generator=gen) < 0.2] = False  # whole sequences rejected (sequence RS, the veto)
    expected = verl_opo(token_rewards.clone(), mask * kept, group.tolist())
    est = estimator_mask(mask, given, kept)
    adv = ADVANTAGES["opo"](OutcomeInputs(token_rewards.sum(-1), token_rewards, est, group))
    torch.testing.assert_close(adv[:, None] * kept, expected, rtol=1e-5, atol=1e-6)
    # the lengths matter: over the whole mask the baseline is another one
    assert not torch.allclose(ours("opo", token_rewards, mask, group) * kept, expected)
    assert torch.equal(estimator_mask(mask, given, given), mask)  # nothing rejected: the mask as it was


def test_opo_keeps_a_truncated_responses_length_and_is_accepted_beside_each_rejection():
    """algorithm.mask_truncated takes a truncated response out of the loss, not out of the baseline: rejection decides
    on the mask without it, and OPO still weighs it by its whole length."""
    from alignrl.rl.trainer import estimator_mask

    mask = torch.ones(3, 4)
    given = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)  # row 1 truncated
    kept = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)  # row 2 lost one token
    assert estimator_mask(mask, given, kept).sum(-1).tolist() == [4.0, 4.0, 3.0]
    for extra in (["algorithm.rollout_rs=seq_mean_k3", "algorithm.rollout_rs_threshold=2.0"],
                  ["algorithm.rollout_token_veto_threshold=0.01"],
                  ["algorithm.rollout_is=token", "algorithm.rollout_is_mode=mask"]):
        assert load_config(None, ["algorithm.adv_estimator=opo", *extra]).algorithm.adv_estimator == "opo"


def _first_tokens_rejected(monkeypatch) -> list:
    """The loop's rollout correction made to reject each response's first token too; the list it returns gets each
    step's (mask it decided on, tokens it kept)."""
    import alignrl.rl.trainer as trainer_module

    decided = []
    correction = trainer_module.PolicyTrainer.rollout_correction

    def first_token_rejected(self, old_lp, rollout_lp, loss_mask):
        weights, kept, metrics = correction(self, old_lp, rollout_lp, loss_mask)
        kept = kept.clone()
        kept[:, 0] = False
        decided.append((loss_mask.clone(), kept))
        return weights, kept, metrics

    monkeypatch.setattr(trainer_module.PolicyTrainer, "rollout_correction", first_token_rejected)
    return decided


def test_the_rl_loop_gives_opo_the_mask_rejection_leaves(tiny_model_dir, tmp_path, monkeypatch):
    """A step of the loop with opo and token rejection, its rejection made to take each response's first token:
    OPO's mask lacks exactly what the loss mask lacks."""
    import alignrl.rl.trainer as trainer_module

    decided, read = _first_tokens_rejected(monkeypatch), []

    def opo(x):
        read.append(x.mask.clone())
        return ADVANTAGES["opo"](x)

    monkeypatch.setattr(trainer_module, "ADVANTAGES", {**ADVANTAGES, "opo": opo})
    _one_step("opo", ["algorithm.rollout_rs=token", "algorithm.rollout_rs_threshold=2.0", "rollout.n=2"],
              tiny_model_dir, tmp_path)
    (given, kept), = decided
    assert len(read) == 1 and given[:, 0].any()
    torch.testing.assert_close(read[0], (given & kept).float())  # no truncation masked here: given is the loss mask


def test_gae_runs_over_the_tokens_rejection_keeps(tiny_model_dir, tmp_path, monkeypatch):
    """verl rewrites the response mask with its rejection before compute_advantage, so its GAE and the whitening after
    it skip rejected tokens: PPO's GAE here reads the same kept mask."""
    import alignrl.rl.trainer as trainer_module

    decided, read = _first_tokens_rejected(monkeypatch), []

    def gae(token_rewards, values, mask, gamma, lam):
        read.append(mask.clone())
        return gae_advantages(token_rewards, values, mask, gamma, lam)

    monkeypatch.setattr(trainer_module, "gae_advantages", gae)
    _one_step("gae", ["algorithm.rollout_rs=token", "algorithm.rollout_rs_threshold=2.0", "critic.enable=true"],
              tiny_model_dir, tmp_path)
    (given, kept), = decided
    assert len(read) == 1 and given[:, 0].any()
    torch.testing.assert_close(read[0], (given & kept).float())


def test_a_shaped_outcome_stays_on_its_token_when_rejection_takes_the_last_one():
    """REINFORCE++ with a group-shaped outcome (OpenRLHF's --advantage_estimator ... with a baseline) adds the shaping
    on the outcome's own token: rejecting that token drops the shaped outcome as a whole, never the raw outcome alone
    (which would leave shaped - outcome as the reward)."""
    from alignrl.core.advantages import outcome_token_rewards, reinforce_pp_advantages, shape_outcome

    full = torch.ones(4, 4)
    kept = full.clone()
    kept[0, 3] = 0.0  # row 0's last token rejected
    outcome, group = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1])
    x = OutcomeInputs(outcome, outcome_token_rewards(outcome, full), kept, group, outcome=outcome,
                      outcome_baseline="mean", whiten="none", reward_mask=full)
    shaped = shape_outcome(outcome, group, "mean")
    want = reinforce_pp_advantages(outcome_token_rewards(shaped, full), kept, whiten="none")
    torch.testing.assert_close(ADVANTAGES["reinforce_plus_plus"](x), want)
    assert bool((ADVANTAGES["reinforce_plus_plus"](x)[0] >= 0).all())  # the group's best answer is not pushed down


def test_a_verl_line_with_opo_and_no_rollout_n_samples_one_response_as_verl():
    verl = ["actor_rollout_ref.actor.ppo_mini_batch_size=2"]
    assert load_config(None, ["algorithm.adv_estimator=opo", *verl]).rollout.n == 1
    assert load_config(None, ["algorithm.adv_estimator=grpo", *verl]).rollout.n == 8  # a group estimator's 8


# ---- the optimal token baselines ------------------------------------------------------------------------------

def _loop_returns_and_weights(token_level_rewards, response_mask, old_log_probs, sum_pi_squared, rollout_is_weights):
    """verl's reward-to-go and cumulative path weights, one token at a time."""
    bsz, seq_len = token_level_rewards.shape
    returns, w_cumulative = torch.zeros_like(token_level_rewards), torch.zeros_like(token_level_rewards)
    for i in range(bsz):
        acc = 0.0
        for t in reversed(range(seq_len)):
            acc = acc + token_level_rewards[i, t] * response_mask[i, t]
            returns[i, t] = acc
        acc = 0.0
        for t in range(seq_len):
            w = 1 - 2 * math.exp(old_log_probs[i, t]) + sum_pi_squared[i, t]
            if rollout_is_weights is not None:
                w = w * rollout_is_weights[i, t] ** 2
            acc = acc + w * response_mask[i, t]
            w_cumulative[i, t] = acc
    return returns, w_cumulative


def _loop_zero_tail(baselines, rows, lengths):
    ordered = sorted(lengths[i] for i in rows)
    longest = [i for i in rows if lengths[i] == ordered[-1]]
    if len(longest) == 1 and ordered[-1] > ordered[-2]:
        baselines[longest[0], int(ordered[-2]):] = 0.0


def verl_optimal_token_baseline(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                                rollout_is_weights=None, epsilon=1e-8):
    returns, w_cumulative = _loop_returns_and_weights(token_level_rewards, response_mask, old_log_probs,
                                                      sum_pi_squared, rollout_is_weights)
    groups = defaultdict(list)
    for i in range(len(index)):
        groups[index[i]].append(i)
    baselines = torch.zeros_like(returns)
    lengths = [float(response_mask[i].sum()) for i in range(len(index))]
    for rows in groups.values():
        if len(rows) == 1:
            continue
        for t in range(returns.shape[1]):
            num = sum(returns[i, t] * w_cumulative[i, t] * response_mask[i, t] for i in rows)
            den = sum(w_cumulative[i, t] * response_mask[i, t] for i in rows) + epsilon
            for i in rows:
                baselines[i, t] = num / den
        _loop_zero_tail(baselines, rows, lengths)
    return (returns - baselines) * response_mask


def verl_tir_optimal_token_baseline(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                                    rollout_is_weights=None, epsilon=1e-8):
    returns, w_cumulative = _loop_returns_and_weights(token_level_rewards, response_mask, old_log_probs,
                                                      sum_pi_squared, rollout_is_weights)
    bsz, seq_len = returns.shape
    lengths = [int(response_mask[i].sum()) for i in range(bsz)]
    width = max(lengths)
    all_w, all_returns = torch.zeros(bsz, width, dtype=returns.dtype), torch.zeros(bsz, width, dtype=returns.dtype)
    for i in range(bsz):
        k = 0
        for t in range(seq_len):
            if response_mask[i, t]:
                all_w[i, k], all_returns[i, k] = w_cumulative[i, t], returns[i, t]
                k += 1
    groups = defaultdict(list)
    for i in range(bsz):
        if lengths[i]:
            groups[index[i]].append(i)
    baselines = torch.zeros_like(all_returns)
    for rows in groups.values():
        if len(rows) == 1:
            continue
        for k in range(width):
            b_star = sum(all_returns[i, k] * all_w[i, k] for i in rows) / (sum(all_w[i, k] for i in rows) + epsilon)
            for i in rows:
                baselines[i, k] = b_star
        _loop_zero_tail(baselines, rows, lengths)
    advantages = torch.zeros_like(returns)
    for i in range(bsz):
        k = 0
        for t in range(seq_len):
            if response_mask[i, t]:
                advantages[i, t] = all_returns[i, k] - baselines[i, k]
                k += 1
    return advantages * response_mask


VERL_TOKEN_BASELINES = {"optimal_token_baseline": verl_optimal_token_baseline,
                        "tir_optimal_token_baseline": verl_tir_optimal_token_baseline}


def token_baseline_batch(seed: int):
    """Groups of one to five, shuffled; ragged lengths, ties among them (the longest tied or alone), an empty row now
    and then; holes in the mask (tool tokens, rejected tokens) in odd seeds; rollout IS weights from seed 4 on; tied
    outcomes in seeds divisible by 3. Log-probs and sums of squared probabilities from one softmax over 6 tokens."""
    gen = torch.Generator().manual_seed(1000 + seed)
    sizes = [int(torch.randint(1, 6, (1,), generator=gen)) for _ in range(5)]
    group = torch.tensor([g for g, n in enumerate(sizes) for _ in range(n)])
    group = group[torch.randperm(len(group), generator=gen)]
    b, t = len(group), 8
    lengths = torch.randint(0 if seed % 4 == 1 else 1, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).double()
    if seed % 2:
        mask = mask * (torch.rand(b, t, generator=gen) > 0.25)
    outcome = torch.randint(0, 3, (b,), generator=gen) / 2.0 if seed % 3 == 0 else torch.randn(b, generator=gen)
    token_rewards = 0.05 * torch.randn(b, t, generator=gen, dtype=torch.float64) * mask
    token_rewards += outcome.double()[:, None] * torch.nn.functional.one_hot(lengths.clamp(min=1) - 1, t)
    probs = torch.softmax(2.0 * torch.randn(b, t, 6, generator=gen, dtype=torch.float64), -1)
    chosen = torch.multinomial(probs.view(-1, 6), 1, generator=gen).view(b, t)
    logprobs = probs.gather(-1, chosen[..., None]).squeeze(-1).log()
    is_weights = torch.rand(b, t, generator=gen, dtype=torch.float64) * 2 * mask if seed >= 4 else None
    return token_rewards, mask, group, logprobs, probs.pow(2).sum(-1), is_weights


@pytest.mark.parametrize("name", TOKEN_BASELINES)
@pytest.mark.parametrize("seed", range(8))
def test_optimal_token_baselines_are_verls(name, seed):
    token_rewards, mask, group, logprobs, spp, is_weights = token_baseline_batch(seed)
    expected = VERL_TOKEN_BASELINES[name](token_rewards, mask, group.tolist(), logprobs, spp, is_weights)
    got = ADVANTAGES[name](OutcomeInputs(token_rewards.sum(-1), token_rewards, mask, group, logprobs=logprobs,
                                         sum_pi_squared=spp, is_weights=is_weights))
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10)
    # the weights matter: one baseline per step of the plain group mean is another one
    if (torch.bincount(group) > 1).any() and float(mask.sum()) > 0:
        flat = VERL_TOKEN_BASELINES[name](token_rewards, mask, group.tolist(), torch.full_like(logprobs, -1e9),
                                          torch.ones_like(spp) * 0.5)
        assert not torch.allclose(got, flat)


def test_the_two_optimal_token_baselines_agree_on_a_mask_without_holes_and_keep_verls_edges():
    token_rewards, mask, group, logprobs, spp, is_weights = token_baseline_batch(4)  # no holes, IS weights
    x = OutcomeInputs(token_rewards.sum(-1), token_rewards, mask, group, logprobs=logprobs, sum_pi_squared=spp,
                      is_weights=is_weights)
    torch.testing.assert_close(ADVANTAGES["optimal_token_baseline"](x), ADVANTAGES["tir_optimal_token_baseline"](x))
    # a response alone keeps its reward-to-go; the longest of a group, past the others, too
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    rewards = torch.tensor([[0, 0, 1.0, 0], [0, 2.0, 0, 0], [0, 0, 0, 3.0]], dtype=torch.float64)
    x = OutcomeInputs(rewards.sum(-1), rewards, mask, torch.tensor([0, 0, 1]), logprobs=torch.full((3, 4), -1.0,
                      dtype=torch.float64), sum_pi_squared=torch.full((3, 4), 0.5, dtype=torch.float64))
    for name in TOKEN_BASELINES:
        adv = ADVANTAGES[name](x)
        assert adv[2].tolist() == [3.0, 3.0, 3.0, 3.0] and adv[0, 2] == 1.0  # alone; past the second-longest
        assert adv[0, 0] == pytest.approx(-0.5) and adv[1, 0] == pytest.approx(0.5)  # equal weights: the mean
    with pytest.raises(ValueError, match="optimal_token_baseline needs the policy's per-token log-probs"):
        ADVANTAGES["optimal_token_baseline"](OutcomeInputs(rewards.sum(-1), rewards, mask, torch.tensor([0, 0, 1])))


@pytest.mark.parametrize("layout", [ForwardLayout(), ForwardLayout(share_prompt=True),
                                    ForwardLayout(remove_padding=True), ForwardLayout(lanes=2)],
                         ids=["plain", "shared", "packed", "lanes"])
def test_the_sums_of_squared_probabilities_are_the_softmaxs_from_the_same_forward(tiny_model, layout):
    from test_actor import _shared_batch

    from alignrl.data.collate import position_ids
    from alignrl.rl.producer import batched_logprobs

    model, _ = tiny_model
    pid, pm, rid, rm, _ = _shared_batch(model.config.vocab_size)
    temperature = 0.7
    lp, spp = batched_logprobs(model, pid, pm, rid, rm, temperature, 5, layout, with_sum_pi_squared=True)
    with torch.no_grad():
        ids, mask = torch.cat([pid, rid], 1), torch.cat([pm, rm], 1)
        logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids(mask)).logits
        want = torch.softmax(logits[:, pid.shape[1] - 1:-1].float() / temperature, -1).pow(2).sum(-1) * rm
    torch.testing.assert_close(spp, want, atol=2e-5, rtol=1e-4)
    assert ((spp > 0) == rm).all()
    # the log-probs are those the plain call gives
    torch.testing.assert_close(lp, batched_logprobs(model, pid, pm, rid, rm, temperature, 5, layout), atol=0, rtol=0)


@pytest.mark.parametrize("extra", [["actor.recompute_old_logprobs=false"], ["algorithm.rollout_is=token"]],
                         ids=["rollout-logprobs", "rollout-is"])
def test_the_rl_loop_hands_the_token_baselines_the_trainers_forward(extra, tiny_model_dir, tmp_path, monkeypatch):
    """With actor.recompute_old_logprobs=false the forward runs for them all the same; rollout IS weights, where the
    run has them, come along."""
    import alignrl.rl.trainer as trainer_module

    read = []

    def otb(x):
        read.append(x)
        return ADVANTAGES["optimal_token_baseline"](x)

    monkeypatch.setattr(trainer_module, "ADVANTAGES", {**ADVANTAGES, "optimal_token_baseline": otb})
    _one_step("optimal_token_baseline", [*extra, "rollout.n=2"], tiny_model_dir, tmp_path)
    (x,), mask = read, read[0].mask.bool()
    assert x.logprobs.shape == x.sum_pi_squared.shape == x.mask.shape and mask.any()
    assert ((x.sum_pi_squared > 0) & (x.sum_pi_squared <= 1 + 1e-6))[mask].all()
    assert (x.sum_pi_squared >= x.logprobs.exp() ** 2 - 1e-6)[mask].all()  # the drawn token's own share
    assert (x.is_weights is not None) == ("algorithm.rollout_is=token" in extra)
