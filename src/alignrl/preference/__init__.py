"""Training from preference pairs: reward and cost models, and the DPO family (safety-aware DPO among them)."""
