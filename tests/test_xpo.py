"""XPO (algorithm.adv_estimator=xpo, `alignrl train xpo`): each prompt's pair is the policy's answer and the reference
model's, the update is the gradient of TRL's XPO loss, the reference's answers come from the reference (the base under
LoRA), what cannot hold one is one line, and TRL's xpo.py line trains the tiny model."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from alignrl.config import ConfigError, load_config
from alignrl.core.online_dpo import PairInputs, online_dpo_advantages
from alignrl.data.records import Experience, Rollout
from alignrl.interfaces import SamplingParams
from alignrl.rl.reference_pairs import ReferencePairEngine, reference_answers
from alignrl.rl.trainer import policy_loss_spec
from alignrl.train.actor import policy_loss

XPO = ["model.path=demo", "algorithm.adv_estimator=xpo", "rollout.n=2", "data.train_batch_size=4",
       "actor.ppo_mini_batch_size=4", "actor.use_kl_loss=false"]


def trl_xpo_loss(logp, ref, mask, rewards, beta: float, alpha: float, loss_type: str) -> torch.Tensor:
    """TRL's XPOTrainer loss, written on its own: rows 0, 2, ... are the policy's answers, 1, 3, ... the reference's;
    the policy's is chosen when its reward is at least the reference's; plus alpha times the policy's summed log-prob
    of the reference's answer."""
    model, theirs = torch.arange(0, len(logp), 2), torch.arange(1, len(logp), 2)
    s, r = (logp * mask).sum(1), (ref * mask).sum(1)
    mine_wins = rewards[model] >= rewards[theirs]
    c, j = torch.where(mine_wins, model, theirs), torch.where(mine_wins, theirs, model)
    logits = (s[c] - r[c]) - (s[j] - r[j])
    dpo = -F.logsigmoid(beta * logits) if loss_type == "sigmoid" else (logits - 1 / (2 * beta)) ** 2
    return (dpo + alpha * s[theirs]).mean()


def _batch():
    gen = torch.Generator().manual_seed(3)
    rows, width = 8, 6
    logp = -torch.rand(rows, width, generator=gen) * 3
    ref = logp + 0.3 * torch.randn(rows, width, generator=gen)
    mask = (torch.arange(width)[None, :] < torch.tensor([6, 2, 5, 1, 4, 6, 3, 3])[:, None]).float()
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.5, 1.0, 0.0, -1.0, 2.0])  # the second pair ties: the policy's is chosen
    return logp, ref, mask, rewards, torch.arange(rows) // 2


@pytest.mark.parametrize("loss_type,beta,alpha", [("sigmoid", 0.1, 1e-5), ("sigmoid", 1.0, 0.2), ("ipo", 0.5, 0.05)])
def test_the_policy_update_is_the_gradient_of_trls_xpo_loss(loss_type, beta, alpha):
    logp, ref, mask, rewards, group = _batch()
    leaf = logp.clone().requires_grad_(True)
    trl_xpo_loss(leaf, ref, mask, rewards, beta, alpha, loss_type).backward()
    expected = leaf.grad
    cfg = load_config(None, [*XPO, f"algorithm.dpo_beta={beta}", f"algorithm.dpo_loss_type={loss_type}",
                             f"algorithm.xpo_alpha={alpha}"])
    adv, metrics = online_dpo_advantages(PairInputs(rewards, group, (logp * mask).sum(1), (ref * mask).sum(1)),
                                         beta, loss_type, cfg.algorithm.xpo_alpha)
    ones = torch.ones(len(logp), 2, dtype=torch.long)
    exp = Experience(ones, ones.bool(), ones, mask.bool(), logp, ref, adv)
    leaf = logp.clone().requires_grad_(True)
    policy_loss(leaf, None, exp, policy_loss_spec(cfg), float(mask.sum()), float(len(logp)))[0].backward()
    torch.testing.assert_close(leaf.grad, expected, rtol=1e-5, atol=1e-7)
    assert metrics["xpo/loss"] == pytest.approx(alpha * float((logp * mask).sum(1)[1::2].mean()), rel=1e-5)
    assert metrics["xpo/policy_chosen"] == 0.5  # pairs 2 (a tie) and 3


class _Fixed:
    """An engine that answers each prompt with one row of `token` and remembers the seeds it was given."""

    def __init__(self, token: int, length: int):
        self.token, self.length, self.seeds, self.loaded = token, length, [], []
        self.pad_id = 0

    def generate(self, prompts, params: SamplingParams) -> Rollout:
        self.seeds.append(params.seed)
        rows = len(prompts) * params.n
        return Rollout(prompt_ids=torch.tensor([list(p) for p in prompts]).repeat_interleave(params.n, 0),
                       prompt_mask=torch.ones(rows, len(prompts[0]), dtype=torch.bool),
                       response_ids=torch.full((rows, self.length), self.token),
                       response_mask=torch.ones(rows, self.length, dtype=torch.bool),
                       logprobs=torch.full((rows, self.length), -float(self.token)),
                       truncated=torch.zeros(rows, dtype=torch.bool),
                       group=torch.arange(len(prompts)).repeat_interleave(params.n))

    def load_weights(self, named_tensors) -> None:
        self.loaded.append(list(named_tensors))


def test_each_prompts_pair_is_the_policys_answer_then_the_references():
    policy, reference = _Fixed(7, 2), _Fixed(9, 3)
    engine = ReferencePairEngine(policy, reference)
    ro = engine.generate([[1, 2], [3, 4], [5, 6]], SamplingParams(n=2, seed=11))
    assert ro.group.tolist() == [0, 0, 1, 1, 2, 2]
    assert ro.prompt_ids.tolist() == [[1, 2], [1, 2], [3, 4], [3, 4], [5, 6], [5, 6]]
    assert ro.response_ids.tolist() == [[7, 7, 0], [9, 9, 9]] * 3  # the shorter answer padded with the pad id
    assert ro.response_mask.sum(1).tolist() == [2, 3] * 3 and ro.logprobs[0].tolist() == [-7.0, -7.0, 0.0]
    # the reference draws its own random numbers: at the start both models are one, and so would their answers be
    assert policy.seeds == [11] and reference.seeds[0] not in (None, 11)
    engine.load_weights([("w", torch.zeros(1))])
    assert len(policy.loaded) == 1 and not reference.loaded  # the reference is frozen
    with pytest.raises(ValueError, match="rollout.n=2 \\(got 4\\)"):
        engine.generate([[1]], SamplingParams(n=4))


def test_the_reference_answers_with_its_own_weights_and_under_lora_as_the_base(tiny_model_dir):
    from alignrl.models import lora
    from alignrl.models.loader import frozen_copy, load_model
    from alignrl.rl.producer import LocalRefScorer
    from alignrl.rollout.hf_engine import HFRolloutEngine

    cfg = load_config(None, [*XPO, f"model.path={tiny_model_dir}"])
    model, tokenizer = load_model(str(tiny_model_dir), "float32", chat=False)[:2]
    base = frozen_copy(model)
    adapted = lora.add_adapters(model, lora.lora_spec(4, 8, 0.0, "all-linear"), task="CAUSAL_LM")
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # adapters that change the answers
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=6, seed=1)
    prompts = [[5, 6, 7], [8, 9]]
    want = HFRolloutEngine(base, tokenizer).generate(prompts, replace(greedy, n=1)).response_ids
    policy = HFRolloutEngine(adapted, tokenizer)
    for ref in (LocalRefScorer(base, 1.0, 4), lora.AdaptersOffScorer(LocalRefScorer(adapted, 1.0, 4), adapted)):
        ro = reference_answers(cfg, policy, ref, tokenizer).generate(prompts, greedy)
        theirs = ro.response_ids[1::2, :want.shape[1]]
        assert torch.equal(theirs, want), type(ref).__name__
        assert not torch.equal(ro.response_ids[0::2, :want.shape[1]], want)  # the adapted policy answers otherwise
    assert reference_answers(load_config(None, ["model.path=demo"]), policy, None, tokenizer) is policy
    with pytest.raises(ConfigError, match="must be loaded where the rollouts are made; this run's is not there"):
        reference_answers(cfg, policy, None, tokenizer)


@pytest.mark.parametrize("given,error", [
    (["agent.max_turns=2"], "episodes with tools or an environment: use online_dpo"),
    (["services.reference_url=http://127.0.0.1:9"], "serves log-probs only: drop it"),
    (["pipeline.placement=zmq", "pipeline.ref_logprobs=trainer"], "set pipeline.ref_logprobs=sampler"),
    (["rollout.n=4"], "algorithm.adv_estimator=xpo pairs each prompt's two answers"),
])
def test_what_cannot_hold_the_reference_beside_the_rollouts_is_one_line(given, error):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*XPO, *given])
    assert error in str(e.value) and "\n" not in str(e.value)


def test_xpo_alpha_without_xpo_is_one_line():
    with pytest.raises(ConfigError, match="algorithm.xpo_alpha is read under algorithm.adv_estimator=xpo, not "
                                          "online_dpo: drop it"):
        load_config(None, [*XPO[:1], "algorithm.adv_estimator=online_dpo", *XPO[2:], "algorithm.xpo_alpha=0.1"])
    with pytest.raises(ConfigError, match="algorithm.xpo_alpha sets the online DPO loss"):
        load_config(None, ["model.path=demo", "algorithm.xpo_alpha=0.1"])
    assert load_config(None, [*XPO, "rollout.temperature=0.7"]).logprob_temperature == 1.0


def test_trls_xpo_line_trains_the_tiny_model_and_logs_both_losses(tmp_path, tiny_model_dir, monkeypatch,
                                                                   cli_in_process):
    from alignrl.compat.trl_online_dpo import from_line

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i}+1?"}],
                                        "solution": str(i + 1)}) + "\n" for i in range(8)))
    words, _ = from_line(["--dataset_name", str(data), "--reward_model_path", "org/rm", "--alpha", "0.001",
                          "--beta", "0.2"], variant="xpo")
    cfg = load_config(None, [w for w in words if "=" in w])
    assert (cfg.algorithm.adv_estimator, cfg.algorithm.xpo_alpha, cfg.algorithm.dpo_beta) == ("xpo", 0.001, 0.2)
    monkeypatch.chdir(tmp_path)
    done = cli_in_process("train", "xpo", "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(data),
                          "--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size", "2",
                          "--max_steps", "2", "--max_new_tokens", "6", "--max_length", "70", "--learning_rate", "1e-2",
                          "--alpha", "0.01", "--gradient_checkpointing", "false",
                          "algorithm.reward_fn=trl:accuracy_reward", "trainer.device=cpu", "data.val_size=2",
                          "trainer.logger=[jsonl]")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "out" / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/grad_norm" in r]
    assert len(steps) == 2 and all(math.isfinite(r["dpo/loss"]) and r["xpo/loss"] < 0 for r in steps)
    # the reference is the policy at the first step, so every pair's log-ratio gap is 0, whichever answers it holds
    assert steps[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-4)


def test_where_no_reference_can_answer_beside_the_rollouts_the_start_says_so():
    """A Ray run holds its reference in a group of its own; under LoRA beside a sharded policy the reference is the
    sharded module itself (a model.ref_path of its own is then sharded too, refused where the producer is built)."""
    from alignrl.placements.ray.driver import check_inputs
    from alignrl.rl.reference_pairs import refuse_sharded_base

    for estimator in ("xpo", "nash_md"):
        cfg = load_config(None, ["model.path=demo", f"algorithm.adv_estimator={estimator}", *XPO[2:]])
        with pytest.raises(ConfigError, match="a Ray run holds it in a group of its own"):
            check_inputs(cfg)
        with pytest.raises(ConfigError, match="use trainer.strategy=ddp, or give the base as model.ref_path"):
            refuse_sharded_base(cfg)
    refuse_sharded_base(load_config(None, [*XPO, "model.ref_path=base"]))  # its own model: no adapters to switch
    refuse_sharded_base(load_config(None, ["model.path=demo"]))
