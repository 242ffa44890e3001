"""A rule cost for PPO-Lagrangian (`safety.cost_fn=examples/length_cost.py:compute_score`).

Cost 1 for a response longer than 40 characters, else 0: a length budget as the constraint, so that
`safety.cost_limit=0.1` asks for at most 10% over-long answers. Same signature as a reward function.
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return 1.0 if len(solution_str) > 40 else 0.0
