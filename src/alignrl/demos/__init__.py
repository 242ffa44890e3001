"""Self-contained demos: each builds its own data and base model from a seed and shows RL learning."""
