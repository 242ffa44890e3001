"""An exponential moving average of the policy's weights (OpenRLHF's --enable_ema with --ema_beta): after every
optimizer step θ_ema ← β·θ_ema + (1 − β)·θ, as OpenRLHF's strategies do it. The average is kept on rank 0 in fp32 host
memory (a bf16 average would drop steps of (1 − β)·Δθ below its rounding), from the full weights every rank gathers
(a collective: a sharded policy is gathered, as for a save). It starts at the policy's weights when the actor is built.

Generation, the held-out evaluation and a resume go on from the policy itself; each checkpoint also holds the average
as a loadable HF folder, `ema/` (config, weights in fp32, tokenizer), which is OpenRLHF's saved model under
--enable_ema, and a resumed run goes on averaging from it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from alignrl.core.ref_mix import mix_into_reference
from alignrl.interfaces import TrainEngine
from alignrl.utils.tracking import console

FOLDER = "ema"


class PolicyAverage:
    """The average of an engine's weights; `stepping(engine)` is the engine whose steps update it."""

    def __init__(self, engine: TrainEngine, beta: float, tokenizer=None, resume: Path | None = None):
        self.engine, self.beta, self.tokenizer = engine, beta, tokenizer
        full = engine.full_state_dict(main_only=True)  # collective; rank 0 keeps the average
        first: dict[int, str] = {}  # a tied weight (input and output embeddings) is one tensor under two names
        for n, t in full.items():
            if t.is_floating_point():
                first.setdefault(id(t), n)
        self.names = list(first.values())  # each tensor once: mixed once a step
        self.average = {n: full[n].detach().to(torch.float32, copy=True) for n in self.names}
        self.average.update({n: self.average[first[id(t)]] for n, t in full.items() if id(t) in first})
        if resume is not None and engine.env.is_main:
            self._load(resume / FOLDER)

    def _load(self, folder: Path) -> None:
        """A resumed run's average, from every weight file of the checkpoint's `ema/` (a large one is split);
        without one (an average new at this resume) it starts from the policy's weights, as said."""
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            console.print(f"no moving average in {folder.parent}: actor.ema_beta starts it from the resumed "
                          "policy's weights", markup=False)
            return
        state = {k: v for f in files for k, v in load_file(f).items()}
        for n in self.names:
            if n in state:  # a tied weight is written once: its other name is the same tensor here
                self.average[n].copy_(state[n])

    def update(self) -> None:
        """After an optimizer step (collective): the average takes 1 − β of the new weights."""
        full = self.engine.full_state_dict(main_only=True)
        if full:
            mix_into_reference([self.average[n] for n in self.names], [full[n] for n in self.names], 1.0 - self.beta)

    def stepping(self, engine: TrainEngine) -> TrainEngine:
        return _AveragedSteps(engine, self)

    def save(self, folder: Path) -> str | None:
        """Checkpoint writer (rank 0): `folder/ema`, a loadable HF folder of the average, or why not."""
        target = folder / FOLDER
        bad = next((n for n in self.names if not torch.isfinite(self.average[n]).all()), None)
        if bad is not None:
            return f"the policy's moving average has NaN/inf weights ({bad})"
        try:
            self.engine.model.save_pretrained(str(target), state_dict=self.average)
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
