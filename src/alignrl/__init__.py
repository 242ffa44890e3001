"""alignrl: reinforcement-learning post-training of language models, from a laptop CPU to a cluster."""

__version__ = "0.1.0"
