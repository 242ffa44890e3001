"""An exponential moving average of the policy's weights (OpenRLHF's --enable_ema with --ema_beta): after every
optimizer step θ_ema ← β·θ_ema + (1 − β)·θ, as OpenRLHF's strategies do it. It is kept in fp32 (a bf16 average would
drop steps of (1 − β)·Δθ below its rounding) and starts at the policy's weights when the actor is built.

Each rank averages only the weights it holds (train.ema_shards says where each part lives): under FSDP2 its own
shards, under DeepSpeed ZeRO-3 its own partitions (from the optimizer's fp32 master partitions), each on the shard's
device; an engine whose every rank holds the whole model (single, ddp, ZeRO-1/2) has rank 0 keep the whole average in
host memory and the other ranks nothing. The update after a step is local: no rank sends or receives anything, where
OpenRLHF's ZeRO-3 average gathers each weight. Only a checkpoint gathers a sharded average, one weight at a time, to
rank 0, which writes it.

Generation, the held-out evaluation and a resume go on from the policy itself; each checkpoint also holds the average
as a loadable HF folder, `ema/` (config, weights in fp32, tokenizer), which is OpenRLHF's saved model under
--enable_ema, and a resumed run goes on averaging from it: each rank reads its own part of the folder's weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from alignrl.config import ConfigError
from alignrl.core.ref_mix import mix_into_reference
from alignrl.interfaces import TrainEngine
from alignrl.train.ema_shards import SavedTensors, layout_of
from alignrl.utils.tracking import console

FOLDER = "ema"


class PolicyAverage:
    """The average of an engine's weights; `stepping(engine)` is the engine whose steps update it. `average` maps
    each weight's name to this rank's part of its average (empty on a rank that keeps none)."""

    def __init__(self, engine: TrainEngine, beta: float, tokenizer=None, resume: Path | None = None):
        self.engine, self.beta, self.tokenizer = engine, beta, tokenizer
        self.layout = layout_of(engine)
        # each tensor once (a tied input and output embedding under its first name): mixed once a step
        self.params = {n: p for n, p in engine.model.named_parameters() if p.is_floating_point()}
        self.names = list(self.params)
        self.average = {n: self.layout.start(p) for n, p in self.params.items()} if self.layout.keeps else {}
        # the state dict's names, taken now, while the engine holds the weights it steps (FSDP2 swaps a module's
        # parameters for gathered ones during a forward)
        self.keys, self.others = self._state_names()
        self.gathered: dict[str, torch.Tensor] | None = None  # a sharded average put together for a checkpoint
        if resume is not None and self.layout.keeps:
            self._load(resume / FOLDER)

    def _state_names(self) -> tuple[dict[str, list[str]], list[str]]:
        """Each averaged weight's names in the model's state dict (a tied weight has two), and the state dict's
        other names (buffers)."""
        names = {id(p): n for n, p in self.params.items()}
        keys: dict[str, list[str]] = {n: [] for n in self.names}
        others = []
        for key, v in self.engine.model.state_dict(keep_vars=True).items():
            if id(v) in names:
                keys[names[id(v)]].append(key)
            else:
                others.append(key)
        return keys, others

    def _load(self, folder: Path) -> None:
        """A resumed run's average, this rank's part of it, from the weight files of the checkpoint's `ema/`; without
        one (an average new at this resume) it starts from the policy's weights, as said."""
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            if self.engine.env.is_main:
                console.print(f"no moving average in {folder.parent}: actor.ema_beta starts it from the resumed "
                              "policy's weights", markup=False)
            return
        saved = SavedTensors(files)
        for n, keys in self.keys.items():
            key = next((k for k in [n, *keys] if k in saved), None)  # a tied weight is written under one name
            if key is None:
                continue
            p = self.params[n]
            if saved.shape(key) != self.layout.shape(p):
                raise ConfigError(f"{folder}: {key} has shape {list(saved.shape(key))}, the policy's "
                                  f"{list(self.layout.shape(p))}: that average is of another model; move {folder} "
                                  "away to start the average from the resumed policy's weights")
            self.average[n].copy_(self.layout.read(saved, key, p))

    def update(self) -> None:
        """After an optimizer step: each part of the average takes 1 − β of the weights' part this rank holds
        (no communication)."""
        if self.average:
            mix_into_reference([self.average[n] for n in self.names],
                               [self.layout.local(self.params[n]) for n in self.names], 1.0 - self.beta)

    def stepping(self, engine: TrainEngine) -> TrainEngine:
        return _AveragedSteps(engine, self)

    def collect(self) -> None:
        """Collective, on every rank as a checkpoint is written (before `save`, which rank 0 alone calls): a sharded
        average is put together on rank 0."""
        self.gathered = self.gather() if self.layout.sharded else None

    def gather(self) -> dict[str, torch.Tensor] | None:
        """Collective for a sharded average: the whole average in rank 0's host memory, by weight name (None on the
        other ranks); the kept average itself where rank 0 keeps it whole."""
        if not self.layout.sharded:
            return self.average if self.engine.env.is_main else None
        whole = {n: self.layout.gather(self.params[n], self.average[n]) for n in self.names}
        return whole if self.engine.env.is_main else None

    def _state_dict(self, whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`whole` under every name of the model's state dict (a tied weight's names share one tensor, so it is
        written once); buffers, which no layout shards, as the model holds them."""
        out = {key: whole[n] for n, keys in self.keys.items() for key in keys}
        if self.others:
            state = self.engine.model.state_dict(keep_vars=True)
            out.update({key: state[key].detach().cpu() for key in self.others})
        return out

    def save(self, folder: Path) -> str | None:
        """Checkpoint writer (rank 0): `folder/ema`, a loadable HF folder of the average, or why not."""
        whole, self.gathered = (self.gathered if self.layout.sharded else self.gather()), None
        if whole is None:
            return "the policy's moving average was not gathered for this checkpoint (PolicyAverage.collect)"
        target = folder / FOLDER
        bad = next((n for n in self.names if not torch.isfinite(whole[n]).all()), None)
        if bad is not None:
            return f"the policy's moving average has NaN/inf weights ({bad})"
        try:
            self.engine.model.save_pretrained(str(target), state_dict=self._state_dict(whole))
            config = self.engine.model.config
            saved_as, config.dtype = config.dtype, "float32"  # the average is written as it is kept
            try:
                config.save_pretrained(str(target))
            finally:
                config.dtype = saved_as
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(str(target))
        except OSError as e:
            return f"the policy's moving average could not be written to {target} ({e.strerror or e})"
        return None


class _AveragedSteps:
    """A TrainEngine whose every optimizer step also moves the average; everything else is the engine's."""

    def __init__(self, engine: TrainEngine, average: PolicyAverage):
        self._engine, self._average = engine, average

    def step(self, skip: bool = False) -> float:
        norm = self._engine.step(skip)
        self._average.update()  # every step, as OpenRLHF's (a skipped one leaves the weights, not the average)
        return norm

    def __getattr__(self, name):
        return getattr(self._engine, name)
