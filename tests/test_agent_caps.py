"""A multi-turn episode's response cap (agent.max_response_length and its verl/Search-R1 spellings): the
episode is cut there, observations included; length shaping (DAPO's overlong penalty) and Dr.GRPO's
seq-mean-token-sum-norm constant use it instead of the per-turn limit. And GRPO with Search-R1's
`actor_rollout_ref.rollout.n_agent=5` runs and samples 5 responses per prompt."""

import math

import pytest
import torch

import alignrl.rl.producer as producer_mod
import alignrl.rl.trainer as trainer_mod
from alignrl.placements.build import build_rewards
from alignrl.placements.episodes import with_tools
from alignrl.runner import train_grpo
from alignrl.rl.trainer import policy_loss_spec
from alignrl.config import ConfigError, load_config
from alignrl.config.checks import response_cap
from alignrl.data.collate import left_pad, right_pad
from alignrl.data.records import Rollout, Sample
from alignrl.interfaces import SamplingParams
from alignrl.rollout.agent import AgentRollout

pytestmark = pytest.mark.timeout(240)

MULTI = ["agent.max_turns=2", "rollout.max_new_tokens=8", "data.max_obs_length=20"]  # most: 3*8 + 2*20 = 64


def test_episode_cap_keys_and_their_verl_spellings():
    assert response_cap(load_config(None, ["rollout.max_new_tokens=8"])) == 8  # single-turn: the per-turn limit
    assert response_cap(load_config(None, MULTI)) == 64  # 0: the most the turns can produce
    assert response_cap(load_config(None, [*MULTI, "agent.max_response_length=30"])) == 30
    assert response_cap(load_config(None, [*MULTI, "agent.max_response_length=500"])) == 64  # never past the turns
    # verl's multi-turn rollout: actor_rollout_ref.rollout.response_length is the whole trajectory
    cfg = load_config(None, ["max_turns=2", "data.max_response_length=8", "data.max_obs_length=20",
                             "actor_rollout_ref.rollout.response_length=40"])
    assert (cfg.agent.max_response_length, cfg.rollout.max_new_tokens, response_cap(cfg)) == (40, 8, 40)
    # Search-R1 keeps a trajectory's first data.max_prompt_length tokens; the seed's 4 turns of 500 + 4
    # observations of 500 (4500) are cut at its 4096
    cfg = load_config(None, ["max_turns=4", "data.max_prompt_length=4096", "data.max_response_length=500",
                             "data.max_obs_length=500", "actor_rollout_ref.rollout.n_agent=2"])
    assert (cfg.agent.max_response_length, response_cap(cfg)) == (4096, 4096)
    cfg = load_config(None, ["max_turns=4", "data.max_prompt_length=4096", "agent.max_response_length=1000",
                             "actor_rollout_ref.rollout.n_agent=2"])
    assert cfg.agent.max_response_length == 1000  # given: kept
    with pytest.raises(ConfigError, match="agent.max_response_length=-1 is out of range"):
        load_config(None, [*MULTI, "agent.max_response_length=-1"])


class Babbler:
    """Every turn writes `<search> q </search>` padded to the turn's token limit: only caps end it."""

    def __init__(self, tok):
        self.ids = tok.encode("<search> q </search>", add_special_tokens=False)
        self.limits: list[int] = []

    def generate(self, prompts, params: SamplingParams) -> Rollout:
        self.limits.append(params.max_new_tokens)
        out = [(self.ids * 10)[: params.max_new_tokens] for _ in prompts]
        pid, pm = left_pad(prompts, 0)
        rid, rm = right_pad(out, 0)
        return Rollout(pid, pm, rid, rm, -rm.float(), torch.zeros(len(prompts), dtype=torch.bool),
                       torch.arange(len(prompts)))

    def load_weights(self, named_tensors):
        pass


class Tool:
    def search(self, queries):
        return ["word " * 50 for _ in queries]  # cut to data.max_obs_length tokens


def test_the_episode_is_cut_at_the_configured_cap_observations_included(tiny_model, retrieval_stub):
    _, tok = tiny_model
    lengths, observed = {}, {}
    for cap in (0, 30, 40):
        cfg = load_config(None, [*MULTI, f"agent.max_response_length={cap}", "rollout.max_new_tokens=12",
                                 f"retriever.url={retrieval_stub}"])  # asked once when the tool is made
        agent = with_tools(cfg, Babbler(tok), tok)
        assert isinstance(agent, AgentRollout)
        agent.tool = Tool()
        ro = agent.generate([[5, 6]], SamplingParams(n=1, max_new_tokens=cfg.rollout.max_new_tokens))
        lengths[cap] = int(ro.response_mask.sum())
        observed[cap] = int((ro.response_mask & ~ro.loss_mask).sum())
        assert lengths[cap] <= response_cap(cfg) and bool(ro.truncated[0]) == (cap != 0)
    assert (lengths[0], observed[0]) == (3 * 12 + 2 * 20, 2 * 20)  # no cap: every turn and observation whole
    # 30: turn 1 (12) and its observation (20) pass the cap: nothing could act on the observation, the
    # episode ends after turn 1
    assert (lengths[30], observed[30]) == (12, 0)
    # 40: 12 + 20, then turn 2 gets only the 8 tokens left: the episode is exactly the cap long
    assert (lengths[40], observed[40]) == (40, 20)


def test_overlong_penalty_and_norm_constant_use_the_episode_cap(tiny_model):
    _, tok = tiny_model
    with pytest.raises(ConfigError, match="overlong_buffer_len=10 must be <= rollout.max_new_tokens=8"):
        load_config(None, ["rollout.max_new_tokens=8", "algorithm.overlong_buffer_len=10"])
    with pytest.raises(ConfigError, match="overlong_buffer_len=70 must be <= the episode's response cap 64"):
        load_config(None, [*MULTI, "algorithm.overlong_buffer_len=70"])
    cfg = load_config(None, [*MULTI, "algorithm.overlong_buffer_len=4", "actor.loss_agg_mode=seq-mean-token-sum-norm"])
    assert policy_loss_spec(cfg).max_len == 64.0  # Dr.GRPO's constant: the episode's cap, not 8 per turn
    single = load_config(None, ["rollout.max_new_tokens=8", "actor.loss_agg_mode=seq-mean-token-sum-norm"])
    assert policy_loss_spec(single).max_len == 8.0
    stage = build_rewards(cfg, tok, torch.device("cpu"))
    assert stage.max_new_tokens == 64
    # episodes of 30 tokens (past one turn's 8, far from the cap): no penalty; 62 (2 into the last 4): -0.5
    lengths = [30, 62]
    rm = torch.arange(64)[None, :] < torch.tensor(lengths)[:, None]
    ro = Rollout(torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.bool),
                 torch.full((2, 64), 11) * rm, rm, torch.zeros(2, 64), torch.zeros(2, dtype=torch.bool),
                 torch.arange(2))
    samples = [Sample([{"role": "user", "content": "q"}], {"target": ["zzz"]}, "nq")] * 2
    scores = stage.score(ro, samples)
    assert scores.rewards.tolist() == [0.0, -0.5]


@pytest.mark.timeout(300)
def test_grpo_with_n_agent_5_samples_five_responses_per_prompt(tiny_model_dir, tmp_path, monkeypatch):
    cfg = load_config(None, [
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n_agent=5", "actor_rollout_ref.rollout.n=1",
        f"actor_rollout_ref.model.path={tiny_model_dir}", "data.train_batch_size=2", "data.max_response_length=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size=5",
        "actor_rollout_ref.rollout.temperature=1.0", "trainer.total_training_steps=2", "trainer.save_freq=0",
        "trainer.test_freq=0", "data.train_size=16", "data.val_size=2", "trainer.logger=[jsonl]",
        "trainer.progress_bar=false", "trainer.threads=1", f"trainer.output_dir={tmp_path}",
        "trainer.experiment_name=n_agent"])
    assert cfg.rollout.n == 5
    # Search-R1 multiplies ppo_mini_batch_size by verl's rollout.n (1), not by n_agent: 2 sequences a step
    assert (cfg.actor.ppo_mini_batch_unit, cfg.mini_batch_sequences) == ("sequences", 2)
    seen: list[Rollout] = []
    score = producer_mod.RolloutMaker.score

    def spy(self, ro, samples, prompts):
        seen.append(ro)
        return score(self, ro, samples, prompts)

    steps = []
    count = trainer_mod.optimizer_steps
    monkeypatch.setattr(producer_mod.RolloutMaker, "score", spy)
    monkeypatch.setattr(trainer_mod, "optimizer_steps", lambda *a: steps.append(count(*a)) or steps[-1])
    summary = train_grpo(cfg)
    assert summary["steps"] == 2 and len(seen) == 2
    assert steps == [5, 5]  # 10 sequences in mini-batches of 2, as Search-R1 updates
    for ro in seen:
        assert ro.group.tolist() == [0] * 5 + [1] * 5  # 2 prompts × 5 samples, contiguous
        for g in range(2):
            rows = (ro.group == g).nonzero().flatten()
            assert all(torch.equal(ro.prompt_ids[rows[0]], ro.prompt_ids[i]) for i in rows)  # one prompt
            texts = {tuple(ro.response_ids[i][ro.response_mask[i]].tolist()) for i in rows}
            assert len(texts) > 1  # sampled, not one response copied 5 times
    assert math.isfinite(summary["final_accuracy"])


def test_gspo_averages_sequences_unless_told_otherwise():
    """verl's GSPO and SAPO terms average sequences whatever loss_agg_mode says; `auto` (the default) gives their KL
    and entropy terms the same, the other losses token-mean, and an explicit mode is followed by those terms."""
    def agg(*over):
        spec = policy_loss_spec(load_config(None, list(over)))
        return spec.loss_agg, spec.policy_agg

    assert agg("actor.policy_loss=gspo") == agg("actor.policy_loss=sapo") == ("seq-mean-token-mean",) * 2
    assert agg() == agg("actor.policy_loss=cispo") == ("token-mean", None)
    # an explicit mode aggregates the KL and entropy terms; the GSPO term averages sequences whatever it says
    assert agg("actor.policy_loss=gspo", "actor.loss_agg_mode=token-mean") == ("token-mean", "seq-mean-token-mean")
    verl = policy_loss_spec(load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=sapo"]))
    assert (verl.loss_agg, verl.policy_agg) == ("token-mean", "seq-mean-token-mean")  # verl's default for the rest
