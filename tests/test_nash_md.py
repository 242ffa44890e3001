"""Nash-MD (algorithm.adv_estimator=nash_md, `alignrl train nash-md`): the update is the gradient of TRL's Nash-MD loss,
the second answer is sampled from the geometric mixture of policy and reference, what cannot sample it is one line, and
TRL's nash_md.py line trains the tiny model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from alignrl.config import ConfigError, load_config
from alignrl.core.nash_md import MixtureInputs, nash_md_advantages
from alignrl.data.records import Experience
from alignrl.interfaces import SamplingParams
from alignrl.rl.reference_pairs import MixtureEngine, reference_answers
from alignrl.rl.trainer import policy_loss_spec
from alignrl.train.actor import policy_loss

NASH = ["model.path=demo", "algorithm.adv_estimator=nash_md", "rollout.n=2", "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4", "actor.use_kl_loss=false"]


def trl_nash_md_loss(logp, ref, mask, rewards, beta: float) -> torch.Tensor:
    """TRL's NashMDTrainer loss, written on its own: rows 0, 2, ... the policy's answers, 1, 3, ... the mixture's; the
    probability the policy's is preferred is the sigmoid of the reward gap; REINFORCE on the policy's answers with a
    control variate of 1/2, and the KL to the reference by REINFORCE."""
    model, mixture = torch.arange(0, len(logp), 2), torch.arange(1, len(logp), 2)
    probability = torch.sigmoid(rewards[model] - rewards[mixture])
    mine = logp[model] * mask[model]
    score = (probability - 0.5) * mine.sum(1)
    log_ratio = ((logp[model] - ref[model]) * mask[model]).detach()
    return (beta * (log_ratio * mine).sum(1) - score).mean()


@pytest.mark.parametrize("beta", [0.1, 1.5])
def test_the_policy_update_is_the_gradient_of_trls_nash_md_loss(beta):
    gen = torch.Generator().manual_seed(5)
    rows, width = 8, 6
    logp = -torch.rand(rows, width, generator=gen) * 3
    ref = logp + 0.3 * torch.randn(rows, width, generator=gen)
    mask = (torch.arange(width)[None, :] < torch.tensor([6, 2, 5, 1, 4, 6, 3, 3])[:, None]).float()
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.5, 1.0, 0.0, -1.0, 2.0])
    leaf = logp.clone().requires_grad_(True)
    trl_nash_md_loss(leaf, ref, mask, rewards, beta).backward()
    expected = leaf.grad
    cfg = load_config(None, [*NASH, f"algorithm.dpo_beta={beta}"])
    adv, metrics = nash_md_advantages(MixtureInputs(rewards, torch.arange(rows) // 2, logp, ref, mask), beta)
    assert adv.shape == (rows, width) and not adv[1::2].any()  # the mixture's answers only score the policy's
    ones = torch.ones(rows, 2, dtype=torch.long)
    exp = Experience(ones, ones.bool(), ones, mask.bool(), logp, ref, adv)
    leaf = logp.clone().requires_grad_(True)
    policy_loss(leaf, None, exp, policy_loss_spec(cfg), float(mask.sum()), float(rows))[0].backward()
    torch.testing.assert_close(leaf.grad, expected, rtol=1e-5, atol=1e-7)
    assert metrics["nash_md/probability"] == pytest.approx(float(torch.sigmoid(rewards[0::2] - rewards[1::2]).mean()))


def test_the_second_answer_is_drawn_from_the_geometric_mixture(tiny_model_dir):
    from alignrl.models.loader import frozen_copy, load_model
    from alignrl.rl.producer import LocalRefScorer
    from alignrl.rollout.hf_engine import HFRolloutEngine

    model, tokenizer = load_model(str(tiny_model_dir), "float32", chat=False)[:2]
    reference = frozen_copy(model)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))  # another model over the same vocabulary
    policy = HFRolloutEngine(model, tokenizer)
    prompts, greedy = [[5, 6, 7], [8, 9]], SamplingParams(n=1, temperature=0.0, max_new_tokens=5)
    # the ends of the mixture are the two models themselves
    assert torch.equal(MixtureEngine(policy, reference, 0.0).generate(prompts, greedy).response_ids,
                       policy.generate(prompts, greedy).response_ids)
    assert torch.equal(MixtureEngine(policy, reference, 1.0).generate(prompts, greedy).response_ids,
                       HFRolloutEngine(reference, tokenizer).generate(prompts, greedy).response_ids)
    # and in between, each token's log-prob is that of (1-c) log pi + c log pi_ref renormalized
    ro = MixtureEngine(policy, reference, 0.3).generate(prompts[:1], SamplingParams(n=1, max_new_tokens=1, seed=4))
    with torch.no_grad():
        mine, theirs = (m(torch.tensor(prompts[:1])).logits[0, -1].log_softmax(-1) for m in (model, reference))
    mixed = (0.7 * mine + 0.3 * theirs).log_softmax(-1)
    assert float(ro.logprobs[0, 0]) == pytest.approx(float(mixed[ro.response_ids[0, 0]]), abs=1e-4)
    cfg = load_config(None, [*NASH, f"model.path={tiny_model_dir}", "algorithm.mixture_coef=0.3"])
    paired = reference_answers(cfg, policy, LocalRefScorer(reference, 1.0, 4), tokenizer)
    assert paired.reference.coef == 0.3 and paired.policy is policy
    with pytest.raises(ConfigError, match="this run generates with _Other"):
        reference_answers(cfg, type("_Other", (), {})(), LocalRefScorer(reference, 1.0, 4), tokenizer)


def test_under_lora_the_mixtures_reference_is_the_base(tiny_model_dir):
    """The policy's own module is both models: its adapters on for the policy, off for the reference."""
    from alignrl.models import lora
    from alignrl.models.loader import frozen_copy, load_model
    from alignrl.rl.producer import LocalRefScorer
    from alignrl.rollout.hf_engine import HFRolloutEngine

    model, tokenizer = load_model(str(tiny_model_dir), "float32", chat=False)[:2]
    base = HFRolloutEngine(frozen_copy(model), tokenizer)
    adapted = lora.add_adapters(model, lora.lora_spec(4, 8, 0.0, "all-linear"), task="CAUSAL_LM")
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    policy = HFRolloutEngine(adapted, tokenizer)
    scorer = lora.AdaptersOffScorer(LocalRefScorer(adapted, 1.0, 4), adapted)
    prompts, greedy = [[5, 6, 7], [8, 9]], SamplingParams(n=2, temperature=0.0, max_new_tokens=5, seed=2)
    for coef, want in ((1.0, base), (0.0, policy)):
        cfg = load_config(None, [*NASH, f"model.path={tiny_model_dir}", f"algorithm.mixture_coef={coef}"])
        ro = reference_answers(cfg, policy, scorer, tokenizer).generate(prompts, greedy)
        alone = want.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=5)).response_ids
        assert torch.equal(ro.response_ids[1::2, :alone.shape[1]], alone), coef
    assert not torch.equal(base.generate(prompts, greedy).response_ids, policy.generate(prompts, greedy).response_ids)


@pytest.mark.parametrize("given,error", [
    (["services.generation_url=http://127.0.0.1:9"], "services.generation_url generates elsewhere: drop it"),
    (["algorithm.dpo_loss_type=ipo"], "algorithm.dpo_loss_type is read under algorithm.adv_estimator=online_dpo or "
                                      "xpo or spin, not nash_md"),
    (["algorithm.xpo_alpha=0.1"], "algorithm.xpo_alpha is read under algorithm.adv_estimator=xpo, not nash_md"),
    (["agent.max_turns=2"], "episodes with tools or an environment"),
    (["actor.ppo_epochs=2"], "takes one optimizer step per batch"),
])
def test_what_nash_md_cannot_go_with_is_one_line(given, error):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*NASH, *given])
    assert error in str(e.value) and "\n" not in str(e.value)


def test_trls_nash_md_line_trains_the_tiny_model(tmp_path, tiny_model_dir, monkeypatch, cli_in_process):
    from alignrl.compat.trl_grpo_flags import TrlFlagError
    from alignrl.compat.trl_online_dpo import from_line

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i}+1?"}],
                                        "solution": str(i + 1)}) + "\n" for i in range(8)))
    line = ["--dataset_name", str(data), "--reward_model_path", "org/rm"]
    words, _ = from_line([*line, "--mixture_coef", "0.25"], variant="nash_md")
    cfg = load_config(None, [w for w in words if "=" in w])
    assert (cfg.algorithm.adv_estimator, cfg.algorithm.mixture_coef, cfg.rollout.n) == ("nash_md", 0.25, 2)
    with pytest.raises(TrlFlagError, match="per-epoch schedule of mixture_coef"):
        from_line([*line, "--mixture_coef", "0.5", "0.2"], variant="nash_md")
    monkeypatch.chdir(tmp_path)
    done = cli_in_process("train", "nash-md", "--model_name_or_path", str(tiny_model_dir), "--dataset_name",
                          str(data), "--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size", "2",
                          "--max_steps", "2", "--max_new_tokens", "6", "--max_length", "70", "--learning_rate", "1e-2",
                          "--gradient_checkpointing", "false", "algorithm.reward_fn=trl:accuracy_reward",
                          "trainer.device=cpu", "data.val_size=2", "trainer.logger=[jsonl]")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "out" / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/grad_norm" in r]
    assert len(steps) == 2 and all(0 < r["nash_md/probability"] < 1 for r in steps)
    assert steps[0]["nash_md/kl"] == pytest.approx(0.0, abs=1e-5)  # the policy is the reference at the first step
    assert all(math.isfinite(r["nash_md/score"]) for r in steps)


@pytest.mark.timeout(400)
def test_zeromq_samplers_draw_the_mixture_as_the_in_process_loop_does(tiny_model_dir, tmp_path):
    """k = 0, one sampler: the sampler builds the same pair engine from its own policy copy and reference, so the run
    ends with exactly the in-process loop's weights."""
    from zmqpipeline import assert_zmq_trains_as_in_process

    reward = tmp_path / "length.py"  # rewards that differ within a pair (the tiny model answers no problem right)
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return len(solution_str) / 10\n")
    assert_zmq_trains_as_in_process(tiny_model_dir, tmp_path, [
        "algorithm.adv_estimator=nash_md", "rollout.n=2", "actor.use_kl_loss=false", "actor.ppo_mini_batch_size=4",
        "algorithm.mixture_coef=0.4", f"algorithm.reward_fn={reward}:compute_score"])
