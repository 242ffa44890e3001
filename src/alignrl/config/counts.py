"""verl's step arithmetic on a loaded config: epochs bounding the steps by the data size, warm-up ratios as optimizer
steps, and the ranks a config asks for (trainer.nnodes x trainer.n_gpus_per_node)."""

from __future__ import annotations

import os
from dataclasses import replace

from alignrl.config.checks import data_files
from alignrl.config.schema import RunConfig


def resolve_counts(cfg: RunConfig, given: set[str], global_micro: int | None = None) -> RunConfig:
    """verl's step arithmetic: `trainer.total_epochs` bounds the steps by the data size, a warm-up
    ratio becomes optimizer steps (verl steps its scheduler once per RL step; alignrl once per
    mini-batch, so the ratio's RL steps are multiplied by the mini-batches of one RL step), and the
    deprecated global `ppo_micro_batch_size` becomes each rank's share of it."""
    t, a, c = cfg.trainer, cfg.actor, cfg.critic
    if global_micro is not None:
        a = replace(a, ppo_micro_batch_size=max(1, global_micro // requested_world_size(cfg)))
    steps = t.total_training_steps
    rows = train_rows(cfg) if t.total_epochs else None
    if rows is not None:  # None: a missing file, which preflight reports before any launch
        # verl's batches of data.gen_batch_size (the training batch without it), the last partial one dropped
        per_epoch = max(1, rows // cfg.data.draw_size)
        by_epochs = t.total_epochs * per_epoch
        steps = min(steps, by_epochs) if "trainer.total_training_steps" in given else by_epochs
    per_step = a.ppo_epochs * cfg.mini_batches_per_step
    actor_warmup = a.lr_warmup_steps or int(a.lr_warmup_steps_ratio * steps) * per_step
    critic_warmup = c.lr_warmup_steps or int(c.lr_warmup_steps_ratio * steps) * per_step
    return replace(cfg, trainer=replace(t, total_training_steps=steps),
                   actor=replace(a, lr_warmup_steps=actor_warmup), critic=replace(c, lr_warmup_steps=critic_warmup))


def train_rows(cfg: RunConfig) -> int | None:
    files = cfg.data.train_files
    if files == "synthetic":
        return cfg.data.train_size
    # imports torch: only epoch-counted runs pay
    from alignrl.data.loaders import count_rows, dataset_class_count, is_library_dataset

    if cfg.data.dataset_class:  # the class makes the rows; verl counts the epochs in them
        rows, cap = dataset_class_count(cfg.data), cfg.data.train_row_cap
        return rows if cap is None else min(rows, cap)
    paths = data_files(files)
    if not all(os.path.isfile(f) or is_library_dataset(f) for f in paths):  # None: a missing file, which preflight
        return None                                                           # reports
    rows, cap = sum(count_rows(f) for f in paths), cfg.data.train_row_cap
    return rows if cap is None else min(rows, cap)  # the rows the loop reads


def requested_world_size(cfg: RunConfig) -> int:
    """Ranks the config asks for (verl's trainer.nnodes × trainer.n_gpus_per_node); a launcher (local
    torchrun, a Ray job) starts that many when no --nproc is given."""
    return cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
