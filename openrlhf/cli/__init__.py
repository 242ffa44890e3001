"""OpenRLHF's entry points: `train_ppo_ray`."""
