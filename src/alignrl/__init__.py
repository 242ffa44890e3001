"""alignrl: reinforcement-learning post-training of language models, from a laptop CPU to a cluster."""

__version__ = "0.1.0"

# Every entry point (the CLI, the seed-named scripts, a Ray worker) imports this package before torch: idle OpenMP
# threads then sleep instead of spinning on a core another process needs (see alignrl.runtime.cores).
from alignrl.runtime.cores import passive_waits as _passive_waits  # noqa: E402

_passive_waits()
