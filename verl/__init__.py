"""Search-R1's entry point spelling, `python3 -m verl.trainer.main_ppo <verl overrides>`, run from the repository
root (or a Ray job's working directory made from it): a shim over `alignrl train ppo`, which takes verl's keys."""
