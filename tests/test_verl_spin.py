"""verl's SPIN recipe (`python3 -m recipe.spin.main_spin`, recipe/spin/run_spin.sh): online DPO whose reference is
replaced by the actor every trainer.ref_update_freq steps, one optimizer step over the whole batch."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from alignrl.compat.verl_spin import spin_words
from alignrl.config import load_config
from test_verl07_scripts import write_math

ROOT = Path(__file__).resolve().parents[1]


def run_spin(model: str, train: str, test: str) -> list[str]:
    """recipe/spin/run_spin.sh (volcengine/verl@872e6e35), shrunk in model, data, GPUs, batch and lengths."""
    return [f"data.train_files={train}", f"data.val_files={test}", "data.train_batch_size=4",
            "data.max_prompt_length=256", "data.max_response_length=8", f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size=2", "actor_rollout_ref.rollout.log_prob_micro_batch_size=2",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.ref.log_prob_micro_batch_size=2",
            "algorithm.kl_ctrl.kl_coef=0.001", "trainer.logger=['console']", "trainer.val_before_train=True",
            "trainer.default_hdfs_dir=null", "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.save_freq=-1",
            "trainer.test_freq=1", "+trainer.log_freq=1", "+trainer.ref_update_freq=1", "trainer.total_epochs=1000"]


@pytest.fixture
def files(tmp_path):
    return write_math(tmp_path / "train.parquet"), write_math(tmp_path / "test.parquet")


def test_the_recipe_line_is_online_dpo_with_the_reference_replaced_every_step(files):
    words, lines = spin_words(run_spin("demo", *files))
    assert words[:2] == ["train", "ppo"]
    cfg = load_config(None, words[2:])
    a = cfg.algorithm
    assert (a.adv_estimator, a.dpo_beta, a.dpo_loss_type, cfg.rollout.n) == ("online_dpo", 0.1, "sigmoid", 2)
    assert (cfg.actor.ref_sync_steps, cfg.actor.ref_mixup_alpha) == (1, 1.0)  # the actor's weights, whole
    assert not cfg.actor.use_kl_loss and cfg.actor.entropy_coeff == 0 and cfg.actor.ppo_epochs == 1
    # one optimizer step over the batch of 4 prompts, whatever ppo_mini_batch_size says, as the recipe's update
    assert cfg.data.train_batch_size == 4 and cfg.mini_batches_per_step == 1
    assert lines == ["actor_rollout_ref.actor.ppo_mini_batch_size=2: verl's SPIN recipe's update reads none of these "
                     "(one optimizer step over the whole batch of 4 prompts, the DPO loss alone), and neither does "
                     "this run"]
    assert cfg.actor.lr_warmup_steps == 15  # spin_trainer.yaml's
    words, lines = spin_words([*run_spin("demo", *files), "actor_rollout_ref.actor.entropy_coeff=0.001",
                               "actor_rollout_ref.actor.ppo_epochs=2"])
    assert load_config(None, words[2:]).actor.ppo_epochs == 1 and "entropy_coeff=0.001" in lines[0]
    quiet = load_config(None, spin_words(["data.train_files=x.parquet", "actor_rollout_ref.model.path=demo"])[0][2:])
    assert quiet.data.train_batch_size == 1024 and quiet.actor.ref_sync_steps == 0  # spin_trainer.yaml's; no sync


@pytest.mark.timeout(600)
def test_the_recipe_entry_point_trains_against_the_actor_of_the_step_before(tiny_model_dir, files, tmp_path):
    """With the reference replaced by the actor after each update, every step's pairs start at the reference: the
    DPO loss is log 2 at each step, not only at the first."""
    from conftest import src_path

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), src_path()]), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "recipe.spin.main_spin", *run_spin(str(tiny_model_dir), *files),
                          "trainer.total_training_steps=2", "trainer.progress_bar=false", "trainer.logger=[jsonl]",
                          f"trainer.output_dir={tmp_path / 'out'}", "trainer.experiment_name=spin"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert "verl's SPIN recipe's update reads none of these (one optimizer step over the whole batch of 4" in run.stderr
    rows = [json.loads(x) for x in (tmp_path / "out" / "spin" / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/grad_norm" in r]
    assert len(steps) == 2 and all(r["dpo/loss"] == pytest.approx(math.log(2), abs=1e-5) for r in steps)
    # both steps moved the policy: the second's pairs started at the reference only because it moved too
    assert steps[0]["actor/grad_norm"] > 0 and steps[1]["actor/grad_norm"] > 0
