"""SPIN (algorithm.adv_estimator=spin): each row's target response is chosen over the reference's (the opponent's)
answer, the update is the gradient of SPIN's loss, a row without a target as text is one line, and a run moves the
policy toward its targets."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from alignrl.config import load_config
from alignrl.core.online_dpo import PairInputs, online_dpo_advantages
from alignrl.data.records import Experience, Sample
from alignrl.errors import DataError
from alignrl.interfaces import SamplingParams
from alignrl.rl.spin_targets import TargetPairEngine
from alignrl.rl.trainer import policy_loss_spec
from alignrl.rollout.env_agent import TaskPrompt
from alignrl.train.actor import policy_loss

SPIN = ["model.path=demo", "algorithm.adv_estimator=spin", "rollout.n=2", "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4", "actor.use_kl_loss=false"]


def spin_loss(logp, ref, mask, beta: float) -> torch.Tensor:
    """SPIN's loss (its logistic loss, DPO's form), written on its own: rows 0, 2, ... the targets, 1, 3, ... the
    opponent's answers; -log sigmoid(beta ((log pi - log pi_ref)(target) - (log pi - log pi_ref)(opponent)))."""
    s, r = (logp * mask).sum(1), (ref * mask).sum(1)
    h = (s[0::2] - r[0::2]) - (s[1::2] - r[1::2])
    return -F.logsigmoid(beta * h).mean()


def test_the_target_is_chosen_whatever_the_rewards_and_the_update_is_spins_gradient():
    gen = torch.Generator().manual_seed(7)
    rows, width = 8, 6
    logp = -torch.rand(rows, width, generator=gen) * 3
    ref = logp + 0.3 * torch.randn(rows, width, generator=gen)
    mask = (torch.arange(width)[None, :] < torch.tensor([6, 2, 5, 1, 4, 6, 3, 3])[:, None]).float()
    rewards = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0])  # the opponent's reward is higher in two pairs
    leaf = logp.clone().requires_grad_(True)
    spin_loss(leaf, ref, mask, 0.1).backward()
    cfg = load_config(None, SPIN)
    adv, metrics = online_dpo_advantages(PairInputs(rewards, torch.arange(rows) // 2, (logp * mask).sum(1),
                                                    (ref * mask).sum(1)), 0.1, "sigmoid", first_chosen=True)
    ones = torch.ones(rows, 2, dtype=torch.long)
    exp = Experience(ones, ones.bool(), ones, mask.bool(), logp, ref, adv)
    got = logp.clone().requires_grad_(True)
    policy_loss(got, None, exp, policy_loss_spec(cfg), float(mask.sum()), float(rows))[0].backward()
    torch.testing.assert_close(got.grad, leaf.grad, rtol=1e-5, atol=1e-7)
    assert metrics["dpo/loss"] == pytest.approx(float(spin_loss(logp, ref, mask, 0.1)), rel=1e-5)


class _Opponent:
    pad_id = 0

    def __init__(self, stops=(3,)):
        self.seeds, self.eos = [], torch.tensor(stops)

    def generate(self, prompts, params):
        from alignrl.data.records import Rollout

        self.seeds.append(params.seed)
        rows = len(prompts)
        return Rollout(prompt_ids=torch.tensor([list(p) for p in prompts]),
                       prompt_mask=torch.ones(rows, len(prompts[0]), dtype=torch.bool),
                       response_ids=torch.full((rows, 2), 9), response_mask=torch.ones(rows, 2, dtype=torch.bool),
                       logprobs=torch.full((rows, 2), -1.0), truncated=torch.zeros(rows, dtype=torch.bool),
                       group=torch.arange(rows))


def test_each_pair_is_the_rows_target_then_the_opponents_answer(tiny_model_dir):
    from alignrl.models.loader import load_model

    tokenizer = load_model(str(tiny_model_dir), "float32", chat=False)[1]
    opponent = _Opponent()
    engine = TargetPairEngine(opponent, tokenizer, eos_id=3)
    rows = [Sample([{"role": "user", "content": "q"}], text) for text in ("12", "seven plus five is 12")]
    prompts = [TaskPrompt([5, 6], rows[0]), TaskPrompt([7, 8], rows[1])]
    ro = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=4, seed=5))
    assert ro.group.tolist() == [0, 0, 1, 1] and ro.prompt_ids.tolist() == [[5, 6], [5, 6], [7, 8], [7, 8]]
    short = tokenizer("12", add_special_tokens=False)["input_ids"] + [3]
    assert ro.response_ids[0, :len(short)].tolist() == short and int(ro.response_mask[0].sum()) == len(short)
    assert not ro.truncated[0] and ro.truncated[2] and int(ro.response_mask[2].sum()) == 4  # cut at the cap
    assert ro.response_ids[1, :2].tolist() == [9, 9] and ro.response_ids[3, :2].tolist() == [9, 9]
    assert opponent.seeds[0] not in (None, 5)
    bad = [TaskPrompt([5, 6], Sample([{"role": "user", "content": "q"}], {"target": ["12"]}, source="rows.jsonl row 3"))]
    with pytest.raises(DataError, match="rows.jsonl row 3 holds dict .*: set data.label_key to the column of target"):
        engine.generate(bad, SamplingParams(n=2, max_new_tokens=4))


def test_the_target_is_tokenized_as_the_policy_would_answer_after_its_prompt(tiny_model_dir):
    """The chat template renders the target as the assistant's turn: its tokens past the prompt, to the turn's own end
    token (which is not always the tokenizer's eos); a prompt the rendering does not begin with (cut to its length
    limit) gets the target tokenized alone."""
    from alignrl.data.collate import prompt_ids
    from alignrl.models.loader import load_model

    tokenizer = load_model(str(tiny_model_dir), "float32", chat=False)[1]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    engine = TargetPairEngine(_Opponent(stops=(end, tokenizer.eos_token_id)), tokenizer, eos_id=end)
    sample = Sample([{"role": "user", "content": "Tom has 3 cats. How many?"}], "3+0=3\n#### 3")
    ids, cut = engine.target(TaskPrompt(prompt_ids(tokenizer, sample), sample), 64)
    rendered = tokenizer.apply_chat_template([*sample.messages, {"role": "assistant", "content": sample.ground_truth}],
                                             tokenize=False)
    assert tokenizer.decode(ids) in rendered and tokenizer.decode(ids).endswith("#### 3<|im_end|>") and not cut
    assert ids[-1] == end and ids.count(end) == 1
    cut_prompt = TaskPrompt(prompt_ids(tokenizer, sample)[3:], sample)  # data.truncation=left kept its tail
    alone = tokenizer(sample.ground_truth, add_special_tokens=False)["input_ids"] + [end]
    assert engine.target(cut_prompt, 64) == (alone, False)
    raw = Sample([{"role": "user", "content": "Q"}], " 4", prompt_text="2 + 2 =")
    raw_ids, _ = engine.target(TaskPrompt(tokenizer("2 + 2 =", add_special_tokens=False)["input_ids"], raw), 64)
    assert tokenizer.decode(raw_ids[:-1]) == " 4" and raw_ids[-1] == end


@pytest.mark.timeout(400)
def test_zeromq_samplers_make_the_pairs_of_the_in_process_loop(tiny_model_dir, tmp_path):
    """k = 0, one sampler: the same targets and opponent answers, so the same weights; the sampler's weight publishes
    reach an engine that samples nothing from the policy."""
    from zmqpipeline import assert_zmq_trains_as_in_process

    assert_zmq_trains_as_in_process(tiny_model_dir, tmp_path, [
        "algorithm.adv_estimator=spin", "rollout.n=2", "actor.use_kl_loss=false", "actor.ppo_mini_batch_size=4"])


def test_a_run_moves_the_policy_toward_its_targets(tiny_model_dir, tmp_path, cli_in_process):
    from conftest import SMALL_GRPO, run_settings

    rows = [{"prompt": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}. #### {i + 1}", "data_source": "openai/gsm8k"}
            for i in range(16)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = tmp_path / "rows.jsonl"
    got = cli_in_process("train", "grpo", *SMALL_GRPO, f"model.path={tiny_model_dir}", f"data.train_files={data}",
                         f"data.val_files={data}", "data.prompt_key=prompt", "data.label_key=answer",
                         "algorithm.adv_estimator=spin", "actor.use_kl_loss=false", "actor.entropy_coeff=0",
                         *run_settings(tmp_path, "spin", 3))
    assert got.returncode == 0, got.stderr[-3000:] + got.stdout[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "spin" / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/grad_norm" in r]
    assert len(steps) == 3 and steps[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-4)
    # the targets grew likelier against the reference, the opponent's answers less so
    assert steps[-1]["rewards/chosen"] > 0 > steps[-1]["rewards/rejected"]
    assert steps[-1]["dpo/loss"] < math.log(2)


def test_dynamic_sampling_which_reads_rewards_is_one_line():
    from alignrl.config import ConfigError

    with pytest.raises(ConfigError, match="reads no rewards .* algorithm.dynamic_sampling would drop pairs by them"):
        load_config(None, [*SPIN, "algorithm.dynamic_sampling=true"])
