"""Training runs on prompts with images, with the tiny Qwen2-VL model: one GRPO step in one process, and PPO with a
vision critic that resumes on FSDP2 and DeepSpeed ZeRO-3 ranks."""

import json

import pytest
import torch

from visionrows import REWARD, color_rows, write_jsonl


@pytest.mark.parametrize("lora", [[], ["model.lora_rank=4"]], ids=["full", "lora"])
def test_grpo_step_in_process_on_images(vl_dir, pictures, tmp_path, lora):
    """One GRPO step with model.path=<tiny VL folder> on LMM-R1 rows, all weights or LoRA adapters: the trainer's
    recomputed log-probs are the engine's (rollout/kl_vs_trainer ~ 0), the weights move, held-out evaluation reads
    the image prompts, and no deprecation warning is raised (a LoRA policy's KV cache went by transformers' old
    argument name through peft's wrapper, which warned at every prompt)."""
    import warnings

    from safetensors.torch import load_file

    from alignrl.config import load_config
    from alignrl.runner import train_grpo

    data = write_jsonl(tmp_path / "train.jsonl", color_rows(pictures))
    (tmp_path / "reward.py").write_text(REWARD)
    cfg = load_config(None, [
        f"model.path={vl_dir}", f"data.train_files={data}", f"data.val_files={data}", "data.prompt_key=message",
        "data.label_key=answer", "data.train_batch_size=2", "data.max_prompt_length=64", "rollout.n=4",
        "rollout.max_new_tokens=8", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=4", "actor.lr=1e-2",
        "actor.kl_loss_coef=0.01", f"algorithm.reward_fn={tmp_path / 'reward.py'}:compute_score",
        "trainer.total_training_steps=1", "trainer.test_freq=1", "trainer.save_freq=1", "trainer.progress_bar=false",
        "trainer.logger=[jsonl]", f"trainer.output_dir={tmp_path}", "trainer.experiment_name=vl", *lora])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", FutureWarning)
        warnings.simplefilter("always", DeprecationWarning)
        summary = train_grpo(cfg)
    assert summary["steps"] == 1
    assert not [str(w.message) for w in said if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    metrics = [json.loads(x) for x in (tmp_path / "vl" / "logs" / "metrics.jsonl").read_text().splitlines()]
    step = metrics[1]
    assert step["rollout/kl_vs_trainer"] < 1e-6 and step["actor/grad_norm"] > 0 and "val/accuracy" in step
    trained = load_file(tmp_path / "vl" / "checkpoints" / "global_step_1" / "model" / "model.safetensors")
    base = load_file(vl_dir / "model.safetensors")
    assert any(not torch.equal(base[k], v) for k, v in trained.items() if k in base)


@pytest.mark.timeout(400)
def test_ppo_with_a_critic_on_images_trains_and_resumes_on_fsdp2_and_deepspeed(vl_dir, pictures, tmp_path):
    """PPO (gae) with the critic initialised from the VL policy's folder: a step in one process trains the policy and
    the critic (values read with the pictures) and saves the critic as a vision value model; two FSDP2 ranks resume
    it (critic weights and optimizer state) for step 2, and two DeepSpeed ZeRO-3 ranks for step 3 (weights: its
    optimizer state is its own format)."""
    import os
    import sys

    from safetensors.torch import load_file

    from alignrl.config import load_config
    from alignrl.runner import train_grpo
    from conftest import run_group

    data = write_jsonl(tmp_path / "train.jsonl", color_rows(pictures))
    (tmp_path / "reward.py").write_text(REWARD)
    common = [
        f"model.path={vl_dir}", f"data.train_files={data}", f"data.val_files={data}", "data.prompt_key=message",
        "data.label_key=answer", "data.train_batch_size=2", "data.max_prompt_length=64", "rollout.n=2",
        "rollout.max_new_tokens=8", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=4", "actor.lr=1e-2",
        "algorithm.adv_estimator=gae", "critic.enable=true", "critic.lr=1e-2", "actor.use_kl_loss=false",
        f"algorithm.reward_fn={tmp_path / 'reward.py'}:compute_score", "trainer.test_freq=0", "trainer.save_freq=1",
        "trainer.progress_bar=false", "trainer.logger=[jsonl]", f"trainer.output_dir={tmp_path}",
        "trainer.experiment_name=vl_ppo"]
    assert train_grpo(load_config(None, common + ["trainer.total_training_steps=1"]))["steps"] == 1
    checkpoints = tmp_path / "vl_ppo" / "checkpoints"
    critic = checkpoints / "global_step_1" / "critic"
    assert json.loads((critic / "config.json").read_text())["architectures"] == ["Qwen2VLForTokenClassification"]
    trained = load_file(critic / "model.safetensors")
    base = load_file(vl_dir / "model.safetensors")
    assert any(k.startswith("visual.") for k in trained) and "score.weight" in trained
    assert any(not torch.equal(base[k], v) for k, v in trained.items() if k in base)  # the backbone trained too
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": "60"}
    for step, engine in ((2, ["trainer.strategy=fsdp2"]), (3, ["trainer.strategy=deepspeed", "trainer.zero_stage=3"])):
        r = run_group([sys.executable, "-m", "alignrl", "train", "grpo", "--nproc", "2", *common, *engine,
                       f"trainer.total_training_steps={step}", "trainer.resume_mode=auto"], 300, env=env)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        assert "returned a view tensor" not in r.stderr  # torch's FSDP2 warning about the critic's logits: noise
        # FSDP2 reads the single process's optimizer state; DeepSpeed keeps its own format and says it starts afresh
        fresh = "no critic optimizer state this backend (deepspeed) can read" in r.stdout
        assert "resumed from" in r.stdout and fresh == (step == 3), r.stdout[-2000:]
        saved = checkpoints / f"global_step_{step}" / "critic"
        assert json.loads((saved / "config.json").read_text())["architectures"] == ["Qwen2VLForTokenClassification"]
        now = load_file(saved / "model.safetensors")
        assert now.keys() == trained.keys()  # whole weights, gathered from the shards, under the same names
        assert any(not torch.equal(trained[k], now[k]) for k in trained if k.startswith("visual."))
        trained = now
    metrics = [json.loads(x) for x in (tmp_path / "vl_ppo" / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m.get("step", 0) > 0]
    assert [m["step"] for m in steps] == [1, 2, 3] and all("critic/values_mean" in m for m in steps), steps
