"""A small GRPO run on the tiny model, as the runner tests configure it, and its checkpoints' weights."""

from pathlib import Path

from safetensors.torch import load_file

SMALL = ["data.train_size=64", "data.val_size=16", "data.val_size_during_training=8", "data.train_batch_size=4",
         "rollout.n=4", "rollout.max_new_tokens=8", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=4",
         "actor.lr=1e-3", "actor.lr_scheduler=cosine", "actor.kl_loss_coef=0.01", "trainer.test_freq=2",
         "trainer.progress_bar=false", "trainer.logger=[jsonl,tensorboard]"]


def overrides(model_dir, out, name, steps, save_freq):
    return SMALL + [f"model.path={model_dir}", f"trainer.output_dir={out}", f"trainer.experiment_name={name}",
                    f"trainer.total_training_steps={steps}", f"trainer.save_freq={save_freq}"]


def weights(run_dir: Path, step: int) -> dict:
    return load_file(run_dir / "checkpoints" / f"global_step_{step}" / "model" / "model.safetensors")
