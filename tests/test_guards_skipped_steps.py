"""The non-finite guard inside the update: a step whose advantages or loss are not finite is skipped and counted (on
one process and on DeepSpeed), and the trainer stops after N skipped RL steps in a row."""

import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from alignrl.rl.trainer import PolicyTrainer, TrainingDiverged
from alignrl.config import load_config
from alignrl.core.advantages import grpo_advantages
from alignrl.data import synthetic
from alignrl.data.collate import encode_prompts
from alignrl.data.records import Experience, ScoredBatch, Scores
from alignrl.runtime.env import SINGLE
from alignrl.rollout.hf_engine import HFRolloutEngine, SamplingParams
from alignrl.train.actor import Actor, PolicyLossSpec, policy_loss
from alignrl.train.engines import OptimSpec, build_engine
from alignrl.train.minibatch import minibatch_updates
from conftest import src_path


def _experience(model, tok, rewards):
    prompts = encode_prompts(tok, synthetic.generate("train", 1, seed=0), 64)
    ro = HFRolloutEngine(model, tok).generate(prompts, SamplingParams(n=len(rewards), max_new_tokens=6, seed=0))
    adv = grpo_advantages(torch.tensor(rewards), ro.group)
    return Experience(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, ro.logprobs, None, adv), ro


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_nan_advantage_skips_the_step_and_counts_it(tiny_model):
    model = copy.deepcopy(tiny_model[0])
    exp, _ = _experience(model, tiny_model[1], [1.0, 0.0, 0.0, 1.0])
    actor = Actor(build_engine("single", model, OptimSpec(lr=1e-2, total_steps=10), SINGLE))
    before, gen = _params(model), torch.Generator().manual_seed(0)
    bad = copy.deepcopy(exp)
    bad.advantages[:2] = math.nan  # one mini-batch of 4 per epoch: both epochs' steps see them
    m = actor.update(bad, PolicyLossSpec(), mini_batch=4, micro_batch=2, epochs=2, generator=gen)
    assert m["actor/skipped_nonfinite"] == 2 and actor.engine.skipped_steps == 2
    assert _same(before, _params(model)) and actor.engine.scheduler.last_epoch == 0
    assert not actor.engine.optimizer.state  # no Adam moments either
    # the NaN gradients were dropped, not carried into the next step: a finite update applies cleanly
    m = actor.update(exp, PolicyLossSpec(), mini_batch=4, micro_batch=4, epochs=1, generator=gen)
    assert m["actor/skipped_nonfinite"] == 0 and math.isfinite(m["actor/grad_norm"])
    after = _params(model)
    assert not _same(before, after) and all(torch.isfinite(v).all() for v in after.values())


def test_nan_loss_with_finite_gradients_is_skipped(tiny_model):
    """A loss made NaN by a term without gradient (so the gradient norm is finite) still skips."""
    model = copy.deepcopy(tiny_model[0])
    exp, _ = _experience(model, tiny_model[1], [1.0, 0.0, 0.0, 1.0])
    engine = build_engine("single", model, OptimSpec(lr=1e-2, total_steps=10), SINGLE)
    from alignrl.models.logprobs import response_logprobs

    def micro_loss(rows, micro, tokens, seqs):
        logp, ent = response_logprobs(model, micro.prompt_ids, micro.prompt_mask, micro.response_ids,
                                      micro.response_mask, with_entropy=True)
        loss, m = policy_loss(logp, ent, micro, PolicyLossSpec(), tokens, seqs)
        return loss + math.nan if bool((rows == 0).any()) else loss, m  # NaN in one mini-batch of two

    before = _params(model)
    m = minibatch_updates(exp, micro_loss, engine, 2, 2, 1, torch.Generator().manual_seed(0), "actor")
    assert m["actor/skipped_nonfinite"] == 1 and engine.skipped_steps == 1
    assert engine.scheduler.last_epoch == 1  # the other mini-batch stepped
    after = _params(model)
    assert not _same(before, after) and all(torch.isfinite(v).all() for v in after.values())


DS_SCRIPT = """
import sys, torch
sys.path.insert(0, {workers!r})
import engine_worker
from alignrl.runtime.env import SINGLE

for stage in (0, 2):  # 0: a plain torch optimizer, checked by us; 2: ZeRO's own check
    engine, exp = engine_worker.make_engine(engine_worker.EngineArgs("deepspeed", stage), SINGLE, {model!r})
    before = {{k: v.clone() for k, v in engine.full_state_dict().items()}}
    for bad in (True, False):
        engine.backward(engine.module(input_ids=exp.prompt_ids).logits.mean() * (float("nan") if bad else 1.0))
        engine.step()
        after = engine.full_state_dict()
        print("RESULT", stage, bad, engine.skipped_steps, engine.scheduler.last_epoch,
              all(torch.equal(before[k], after[k]) for k in before), all(bool(torch.isfinite(v).all())
                                                                        for v in after.values()))
import os  # the one-rank group leaves no launcher variables behind for a torchrun this process might start later
print("LEFT", [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k in os.environ])
"""


@pytest.mark.slow
def test_deepspeed_skips_a_nan_step(tiny_model_dir):
    # both stages in one process: its start-up (torch, transformers, DeepSpeed) costs more than the steps
    script = DS_SCRIPT.format(workers=str(Path(__file__).parent / "workers"), model=str(tiny_model_dir))
    env = {**{k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")},
           "PYTHONPATH": src_path(), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    results = [x.split()[1:] for x in r.stdout.splitlines() if x.startswith("RESULT")]
    # the NaN step: counted, no lr step, weights untouched; the next step applies and stays finite
    expected = [row for stage in ("0", "2") for row in ([stage, "True", "1", "0", "True", "True"],
                                                       [stage, "False", "1", "1", "False", "True"])]
    assert results == expected, r.stdout
    assert "LEFT []" in r.stdout.splitlines(), r.stdout


class _Sink:
    def publish(self, version):
        self.version = version


def test_trainer_stops_after_n_skipped_steps_in_a_row(tiny_model, capsys):
    cfg = load_config(None, ["trainer.max_nonfinite_updates=2", "rollout.n=4", "actor.ppo_mini_batch_size=1",
                             "actor.ppo_micro_batch_size=4", "actor.use_kl_loss=false", "data.train_batch_size=1"])
    model = copy.deepcopy(tiny_model[0])
    trainer = PolicyTrainer(cfg, Actor(build_engine("single", model, OptimSpec(lr=1e-2, total_steps=10), SINGLE)),
                            _Sink())
    _, ro = _experience(model, tiny_model[1], [1.0, 0.0, 0.0, 1.0])

    def batch(rewards):
        scores = Scores(torch.tensor(rewards), torch.zeros(4, dtype=torch.bool))
        return ScoredBatch(ro, scores, ro.response_mask.clone(), None, torch.zeros(4, dtype=torch.long))

    nan = [math.nan, 0.0, 1.0, 0.0]
    before = _params(model)
    assert trainer.train(1, batch(nan))["actor/skipped_nonfinite"] == 1 and trainer.version == 1
    assert _same(before, _params(model))
    said = capsys.readouterr().out  # a skipped update is said on the console, not only in a metric
    assert ("step 1: 1 of 1 optimizer step(s) skipped: a non-finite loss or gradient norm (1 RL step(s) in a row "
            "wholly skipped; the run stops at trainer.max_nonfinite_updates=2)") in " ".join(said.split()), said
    assert trainer.train(2, batch([1.0, 0.0, 0.0, 1.0]))["actor/skipped_nonfinite"] == 0  # resets the count
    trainer.train(3, batch(nan))
    with pytest.raises(TrainingDiverged) as e:
        trainer.train(4, batch(nan))
    assert trainer.version == 3, "the failed step publishes nothing"
    assert str(e.value).startswith("training stopped at step 4: every update of the last 2 RL step(s) had a "
                                   "non-finite loss or gradient norm and was skipped; ")
