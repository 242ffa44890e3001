"""verl's recipe entry points, spelled as verl's scripts call them from the repository root (`python3 -m
recipe.dapo.main_dapo <verl overrides>`): shims over `alignrl train ppo`, which takes verl's keys."""
