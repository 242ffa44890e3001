"""The value model and the critic's update."""

import time

import torch

from alignrl.data import synthetic
from alignrl.data.collate import encode_prompts
from alignrl.data.records import Experience
from alignrl.models.value import load_value_model, response_values
from alignrl.rollout.hf_engine import HFRolloutEngine, SamplingParams
from alignrl.runtime.env import SINGLE
from alignrl.train.critic import Critic
from alignrl.train.engines import OptimSpec, build_engine


def _rollout(tiny_model):
    model, tok = tiny_model
    prompts = encode_prompts(tok, synthetic.generate("train", 3, seed=0), 64)
    return HFRolloutEngine(model, tok).generate(prompts, SamplingParams(n=2, max_new_tokens=6, seed=0))


def test_value_model_loads_from_policy_and_is_seeded(tiny_model_dir, tmp_path):
    a = load_value_model(str(tiny_model_dir), seed=1, log=lambda *_: None)
    b = load_value_model(str(tiny_model_dir), seed=1, log=lambda *_: None)
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), na
    a.save_pretrained(tmp_path / "critic")
    c = load_value_model(str(tmp_path / "critic"), seed=99, log=lambda *_: None)  # head comes from the folder
    torch.testing.assert_close(c.score.weight, a.score.weight)


def test_value_model_has_no_dropout_so_training_mode_values_are_the_values(tiny_model, tiny_model_dir):
    """The token-classification head comes with dropout 0.1; a critic trained in training mode would see
    noisy values, and DDP ranks would draw other masks than one process (and train apart from it)."""
    ro = _rollout(tiny_model)
    model = load_value_model(str(tiny_model_dir), log=lambda *_: None).train()
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    args = ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask
    with torch.no_grad():
        torch.testing.assert_close(response_values(model, *args), response_values(model.eval(), *args), rtol=0, atol=0)


def _critic(model_dir, lr, total_steps, cliprange_value):
    model = load_value_model(str(model_dir), log=lambda *_: None)
    return Critic(build_engine("single", model, OptimSpec(lr=lr, total_steps=total_steps), SINGLE),
                  cliprange_value=cliprange_value)


def test_batched_values_match_per_row(tiny_model, tiny_model_dir):
    ro = _rollout(tiny_model)
    critic = _critic(tiny_model_dir, 1e-3, 10, 0.5)
    v = critic.values(ro, micro_batch=2)
    with torch.no_grad():
        for i in range(len(ro.group)):
            n = int(ro.response_mask[i].sum())
            p = ro.prompt_mask[i]
            one = response_values(critic.model, ro.prompt_ids[i:i + 1, p], p[None, p],
                                  ro.response_ids[i:i + 1, :n], ro.response_mask[i:i + 1, :n])
            torch.testing.assert_close(v[i, :n], one[0], atol=1e-5, rtol=0)
    assert torch.all(v[~ro.response_mask] == 0)


def test_critic_update_moves_values_toward_returns(tiny_model, tiny_model_dir):
    ro = _rollout(tiny_model)
    critic = _critic(tiny_model_dir, 3e-3, 50, None)
    exp = Experience(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, ro.logprobs, None,
                     torch.zeros(len(ro.group)))
    returns = ro.response_mask.float() * 1.0
    err = lambda v: float(((v - returns) ** 2)[ro.response_mask].mean())  # noqa: E731
    before = err(critic.values(ro, 6))
    for _ in range(20):
        metrics = critic.update(exp, critic.values(ro, 6), returns, 6, 3, 1, torch.Generator().manual_seed(0))
    assert err(critic.values(ro, 6)) < 0.2 * before
    assert {"critic/vf_loss", "critic/grad_norm", "critic/lr"} <= set(metrics)


def test_model_scorer_reads_the_last_real_token(tiny_model, tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from alignrl.models.value import ModelScorer

    torch.manual_seed(0)
    seq_cls = AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1)
    seq_cls.save_pretrained(tmp_path / "cost_model")
    tiny_model[1].save_pretrained(tmp_path / "cost_model")
    scorer = ModelScorer(str(tmp_path / "cost_model"), log=lambda *_: None)
    ro = _rollout(tiny_model)
    scores = scorer.score(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
    assert scores.shape == (len(ro.group),)
    with torch.no_grad():
        for i in range(len(ro.group)):  # one unpadded sequence at a time through HF's own head
            ids = torch.cat([ro.prompt_ids[i, ro.prompt_mask[i]], ro.response_ids[i, ro.response_mask[i]]])[None]
            torch.testing.assert_close(scores[i], seq_cls(input_ids=ids).logits[0, 0], atol=1e-5, rtol=0)


def test_a_critic_rank_keeps_the_reward_and_cost_critics_rounds_apart():
    """Two actor ranks share one critic rank (PPO-Lagrangian: a reward and a cost critic, each counting its
    own rounds). Rank A brings the last part of the reward critic's round 1 and goes straight on to the cost
    critic's round 1, while rank B still waits for the reward critic's result: keyed by round alone, A took
    the reward critic's metrics as the cost critic's and B waited in vain."""
    import threading

    from alignrl.placements.ray.critic import CriticRank
    from alignrl.config import RunConfig, to_yaml

    class Recording:
        def __init__(self, name):
            self.name, self.rows = name, []

        def update(self, exp, old_values, returns, mini, micro, epochs, gen):
            self.rows.append(len(old_values))
            return {f"{self.name}/vf_loss": float(len(self.rows))}

    one = torch.zeros(1, 1)
    exp = Experience(one.long(), one.bool(), one.long(), one.bool(), one, None, one)
    for _ in range(5):
        rank = CriticRank(to_yaml(RunConfig()), 0, 1, 0, 0, 2, 2.0)
        rank.critics = {"critic": Recording("critic"), "cost_critic": Recording("cost_critic")}
        got_b = {}

        def actor_rank_b():
            got_b["critic"] = rank.update("critic", 1, 1, exp, one, one, 1, 1, 1, 0)
            got_b["cost_critic"] = rank.update("cost_critic", 1, 1, exp, one, one, 1, 1, 1, 0)

        b = threading.Thread(target=actor_rank_b, daemon=True)
        b.start()
        while not rank.pending:  # B waits for the rest of the reward critic's round
            time.sleep(0.001)
        got_a = {name: rank.update(name, 1, 0, exp, one, one, 1, 1, 1, 0) for name in ("critic", "cost_critic")}
        b.join(10)
        assert got_a == got_b == {"critic": {"critic/vf_loss": 1.0}, "cost_critic": {"cost_critic/vf_loss": 1.0}}
        assert [c.rows for c in rank.critics.values()] == [[2], [2]] and not rank.pending and not rank.results
