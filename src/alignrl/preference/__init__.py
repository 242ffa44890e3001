"""Training from preference pairs: reward and cost models, and the DPO family with Safe-MM-DPO as its default;
all weights or LoRA adapters; the Safe-MM-DPO project's own config files read as they are (`mmdpo_keys`)."""
