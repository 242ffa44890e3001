"""State masking: tool-observation tokens are attended but never trained on (policy loss, entropy, KL,
critic); GAE carries values over them; an end-to-end multi-turn PPO step against `alignrl serve retrieve`."""

import pytest
import torch

import alignrl.train.actor as actor_mod
import alignrl.train.critic as critic_mod
from alignrl.placements.episodes import with_tools
from alignrl.placements.local import place
from alignrl.config import ConfigError, load_config
from alignrl.core.advantages import gae_advantages
from alignrl.core.entropy import entropy_from_logits
from alignrl.core.losses import value_loss
from alignrl.data.collate import encode_prompts, right_pad
from alignrl.data.records import Experience, Rollout, Sample
from alignrl.rollout.agent import AgentRollout
from alignrl.rollout.retriever import RetrieverClient
from alignrl.serve.process import ServiceProcess
from alignrl.train.actor import PolicyLossSpec, policy_loss

pytestmark = pytest.mark.timeout(240)


def _policy_grad(loss_mask: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """d(policy loss + KL - entropy bonus)/d logits (B, R, V), as the actor computes them."""
    g = torch.Generator().manual_seed(0)
    b, r, v = loss_mask.shape[0], loss_mask.shape[1], 11
    logits = torch.randn(b, r, v, generator=g).requires_grad_()
    ids = torch.randint(0, v, (b, r), generator=g)
    logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1) * attended
    ent = entropy_from_logits(logits) * attended
    exp = Experience(torch.ones(b, 1, dtype=torch.long), torch.ones(b, 1, dtype=torch.bool), ids, loss_mask,
                     (logp.detach() + 0.1 * torch.randn(b, r, generator=g)) * attended, torch.randn(b, r, generator=g),
                     torch.randn(b, r, generator=g), response_attention=attended)
    spec = PolicyLossSpec(kl_coef=0.5, kl_type="k3", entropy_coeff=0.1)
    loss, _ = policy_loss(logp, ent, exp, spec, float(loss_mask.sum()), float(b))
    loss.backward()
    return logits.grad


def test_observation_logits_get_exactly_zero_gradient():
    attended = torch.ones(2, 8, dtype=torch.bool)
    generated = attended.clone()
    generated[0, 2:5] = False  # an observation inside row 0
    generated[1, 1:3] = False
    grad = _policy_grad(generated, attended)
    assert bool((grad[~generated] == 0).all())
    assert bool((grad[generated].abs().sum(-1) > 0).all())
    grad = _policy_grad(attended, attended)  # without state masking observations are trained like the rest
    assert bool((grad[~generated].abs().sum(-1) > 0).all())


def test_critic_loss_ignores_observation_values():
    generated = torch.tensor([[True, False, False, True, True]])
    values = torch.randn(1, 5, requires_grad=True)
    loss, _ = value_loss(values, values.detach(), torch.randn(1, 5) + 5, generated.float(), 0.2)
    loss.backward()
    assert bool((values.grad[~generated] == 0).all()) and bool((values.grad[generated] != 0).all())


def test_gae_carries_values_over_observations():
    """GAE over a response with an observation inside equals GAE over the generated tokens alone."""
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0]], dtype=torch.float32)
    rewards, values = torch.randn(1, 8, generator=g), torch.randn(1, 8, generator=g)
    adv, ret = gae_advantages(rewards * mask, values, mask, gamma=0.9, lam=0.8)
    keep = mask[0].bool()
    adv_c, ret_c = gae_advantages((rewards * mask)[:, keep], values[:, keep], torch.ones(1, int(keep.sum())), 0.9, 0.8)
    torch.testing.assert_close(adv[:, keep], adv_c)
    torch.testing.assert_close(ret[:, keep], ret_c)
    assert bool((adv[:, ~keep] == 0).all())


def test_masking_off_without_recomputed_logprobs_is_a_config_error(tiny_model):
    with pytest.raises(ConfigError, match="recompute_old_logprobs"):  # refused as the config loads
        load_config(None, ["agent.max_turns=2", "actor.state_masking=false", "actor.recompute_old_logprobs=false"])
    assert with_tools(load_config(None, []), "engine", tiny_model[1]) == "engine"  # single-turn: unwrapped


class FirstTurnSearches:
    """Scripted first turn `<search> QUERY </search>` for every row, then the real engine: a random tiny
    model never writes a search itself."""

    def __init__(self, inner, tokenizer, query: str):
        self.inner, self.calls = inner, 0
        self.ids = tokenizer.encode(f"<search> {query} </search>", add_special_tokens=False)

    def generate(self, prompts, params):
        self.calls += 1
        if self.calls > 1:
            return self.inner.generate(prompts, params)
        rid, rm = right_pad([self.ids] * len(prompts), 0)
        b = len(prompts)
        return Rollout(torch.zeros(b, 1, dtype=torch.long), torch.ones(b, 1, dtype=torch.bool), rid, rm,
                       -0.5 * rm.float(), torch.zeros(b, dtype=torch.bool), torch.arange(b))

    def load_weights(self, named_tensors):
        self.inner.load_weights(named_tensors)


@pytest.fixture(scope="module")
def retriever(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("retrieve")
    with ServiceProcess(["retrieve", "--retriever_name", "bm25", "--index_path", str(tmp / "index")],
                        env={"ALIGNRL_CACHE": str(tmp / "cache"), "HF_HUB_OFFLINE": "1"}, startup_s=180) as s:
        yield s.url + "/retrieve"


def test_real_retriever_answers_in_search_r1_layout(retriever):
    client = RetrieverClient(retriever, topk=2)
    found = client.search(["capital city of canada", "mount everest height " + "x" * 9000])  # one request
    assert found[0].startswith('Doc 1(Title: "Ottawa") ') and "\nDoc 2(Title: " in found[0]
    assert found[1].startswith("Doc 1(Title: ") and found[1].count("\nDoc ") == 1 and client.cut_queries == 1


def _step(tiny_model_dir, tmp_path, url, monkeypatch, masking: bool):
    """One PPO step (GAE, critic, KL in loss and reward, entropy bonus) on a 2-turn search rollout.
    Returns the batch and, per micro-batch, (d loss / d token log-prob, loss mask, attention, ids)."""
    cfg = load_config(None, [
        f"model.path={tiny_model_dir}", f"trainer.output_dir={tmp_path}", "data.train_batch_size=2", "rollout.n=2",
        "rollout.max_new_tokens=6", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=2",
        "algorithm.adv_estimator=gae", "critic.enable=true", "algorithm.use_kl_in_reward=true",
        "actor.entropy_coeff=0.01", "actor.kl_loss_coef=0.1", "agent.max_turns=2", f"retriever.url={url}",
        "data.max_obs_length=48", f"actor.state_masking={str(masking).lower()}", "trainer.progress_bar=false"])
    placed = place(cfg, str(tiny_model_dir))
    agent = placed.maker.engine
    assert isinstance(agent, AgentRollout) and isinstance(placed.eval_engine, AgentRollout)
    tok = placed.tokenizer
    agent.engine = FirstTurnSearches(agent.engine, tok, "capital city of canada")
    samples = [Sample([{"role": "user", "content": "What is the capital of Canada?"}], "7"),
               Sample([{"role": "user", "content": "Where is Mount Everest?"}], "8")]
    batch = placed.maker.make(1, [0, 1], lambda idx: ([samples[i] for i in idx],
                                                      encode_prompts(tok, [samples[i] for i in idx], 64)))
    batch.rollout.response_ids[0, 1] = tok.pad_token_id  # a generated token equal to the pad id
    seen = []
    orig_policy, orig_value = actor_mod.policy_loss, critic_mod.value_loss

    def spy_policy(logp, entropy, exp, *args):
        logp.register_hook(lambda g: seen.append(("actor", g.clone(), exp.response_mask, exp.attended,
                                                  exp.response_ids)))
        return orig_policy(logp, entropy, exp, *args)

    def spy_value(values, old, returns, mask, *args, **kw):
        values.register_hook(lambda g: seen.append(("critic", g.clone(), mask.bool(), None, None)))
        return orig_value(values, old, returns, mask, *args, **kw)

    monkeypatch.setattr(actor_mod, "policy_loss", spy_policy)
    monkeypatch.setattr(critic_mod, "value_loss", spy_value)
    metrics = placed.trainer.train(1, batch)
    return batch, seen, metrics, tok


def _observation_grads(batch, seen):
    """The actor's gradients on observation tokens, micro-batch rows matched back to the batch's rows."""
    ro, out = batch.rollout, []
    obs = ro.response_mask & ~ro.loss_mask
    for who, grad, _, attended, ids in seen:
        if who != "actor":
            continue
        r1 = ids.shape[1]
        for i in range(ids.shape[0]):
            j = next(j for j in range(len(ro.group)) if torch.equal(ro.response_ids[j, :r1], ids[i])
                     and torch.equal(ro.response_mask[j, :r1], attended[i]))
            out.append(grad[i][obs[j, :r1]])
    return torch.cat(out)


def test_multi_turn_step_never_trains_on_observations(tiny_model_dir, tmp_path, retriever, monkeypatch):
    batch, seen, metrics, tok = _step(tiny_model_dir, tmp_path, retriever, monkeypatch, masking=True)
    ro = batch.rollout
    assert (ro.response_mask & ~ro.loss_mask).any() and torch.equal(batch.loss_mask, ro.loss_mask)
    text = tok.decode(ro.response_ids[1][ro.response_mask[1]])
    assert "<information>Doc 1(Title: " in text  # the real server's passages, cut to max_obs_length
    assert batch.metrics["agent/searches_per_episode"] == 1.0 and batch.metrics["agent/turns"] >= 2
    assert {"actor", "critic"} <= {s[0] for s in seen}
    trained_pad = False
    for who, grad, loss_mask, _, ids in seen:
        assert bool((grad[~loss_mask] == 0).all()), who
        assert bool((grad[loss_mask] != 0).any()), who
        if who == "actor":
            trained_pad |= bool((grad[(ids == tok.pad_token_id) & loss_mask] != 0).any())
    assert trained_pad  # loss masks come from the rollout, never from pad ids
    obs_grads = _observation_grads(batch, seen)
    assert obs_grads.numel() > 0 and bool((obs_grads == 0).all())
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


def test_without_state_masking_observations_are_trained(tiny_model_dir, tmp_path, retriever, monkeypatch):
    batch, seen, _, _ = _step(tiny_model_dir, tmp_path, retriever, monkeypatch, masking=False)
    assert torch.equal(batch.loss_mask, batch.rollout.response_mask)
    obs_grads = _observation_grads(batch, seen)
    assert obs_grads.numel() > 0 and bool((obs_grads != 0).any())


def _multi_turn_rollout() -> Rollout:
    rm = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    gen = rm & ~torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    return Rollout(torch.ones(3, 2, dtype=torch.long), torch.ones(3, 2, dtype=torch.bool), torch.arange(15).view(3, 5),
                   rm, -gen.float(), torch.zeros(3, dtype=torch.bool), torch.tensor([0, 0, 1]), loss_mask=gen,
                   stats={"searches": torch.tensor([1.0, 1.0, 0.0])})


def test_masks_survive_dynamic_sampling_and_the_wire(tiny_model):
    from alignrl.rl.rollout_ops import concat_rollouts, select_groups
    from alignrl.data.records import ScoredBatch, Scores
    from alignrl.wire.records import from_wire, to_wire
    from alignrl.wire.frames import Message

    ro = _multi_turn_rollout()
    kept = select_groups(ro, [1])
    assert torch.equal(kept.loss_mask, ro.loss_mask[2:]) and kept.stats["searches"].tolist() == [0.0]
    both = concat_rollouts(kept, ro, pad_id=0)
    assert torch.equal(both.loss_mask[1:], ro.loss_mask) and both.stats["searches"].tolist() == [0.0, 1.0, 1.0, 0.0]
    single = Rollout(*(getattr(kept, f) for f in ("prompt_ids", "prompt_mask", "response_ids", "response_mask",
                                                  "logprobs", "truncated", "group")))
    assert torch.equal(concat_rollouts(single, ro, 0).loss_mask[0], kept.response_mask[0])
    batch = ScoredBatch(ro, Scores(torch.zeros(3), torch.zeros(3, dtype=torch.bool)), ro.loss_mask.clone(), None,
                        torch.tensor([4, 4, 9]))
    meta, tensors = to_wire(batch, tiny_model[1])
    tok = tiny_model[1]
    assert meta["prefix"] == [tok.decode(ro.prompt_ids[i][ro.prompt_mask[i]]) for i in range(3)]  # one per row
    back = from_wire(Message("scored_batch", meta, tensors))
    assert torch.equal(back.rollout.loss_mask, ro.loss_mask) and torch.equal(back.loss_mask, batch.loss_mask)
