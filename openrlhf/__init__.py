"""OpenRLHF's (and LMM-R1's) module spellings, run from the repository root (or a Ray job's working directory made
from it): `python -m openrlhf.models.remote_rm.math_verifier ...` and `python3 -m openrlhf.cli.train_ppo_ray ...`
are shims over `alignrl serve reward --protocol openrlhf` and `alignrl train ppo-ray`."""
