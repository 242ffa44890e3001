"""Run under torchrun with 2 ranks, each holding its share of one batch: the logged metrics of the whole batch
must be what one process holding all of it logs (a maximum the largest share's, the reward spread the whole
batch's, tokens/s the ranks' sum). Exits non-zero otherwise."""

import math
import sys

import torch

from alignrl.rl.producer import pooled_std
from alignrl.runtime.env import gather_tensor, gather_values, init_distributed, mean_metrics, shutdown

REWARDS = [[0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]]
LENGTHS = [[3, 9, 4, 4, 5, 6, 2, 7], [31, 2, 4, 5, 6, 8, 1, 3]]


def main() -> int:
    torch.set_num_threads(1)
    env = init_distributed(timeout_s=60)
    r, n = torch.tensor(REWARDS[env.rank]), torch.tensor(LENGTHS[env.rank], dtype=torch.float32)
    mine = {"reward/mean": float(r.mean()), "response/length_max": float(n.max()), "length_min": float(n.min()),
            "perf/tokens_per_s": 100.0 * (env.rank + 1)}
    mine["reward/std"] = pooled_std(env, mine["reward/mean"], float(r.std()), len(r))
    got = mean_metrics(env, mine)
    whole_r, whole_n = torch.tensor(sum(REWARDS, [])), torch.tensor(sum(LENGTHS, []), dtype=torch.float32)
    want = {"reward/mean": float(whole_r.mean()), "reward/std": float(whole_r.std()),
            "response/length_max": float(whole_n.max()), "length_min": float(whole_n.min()), "perf/tokens_per_s": 300.0}
    for k, v in want.items():
        assert math.isclose(got[k], v, rel_tol=1e-6), (k, got[k], v)
    costs = gather_values(env, [0.5, -1.0, 2.0] if env.rank == 0 else [4.0])
    assert costs == [0.5, -1.0, 2.0, 4.0], costs
    share = torch.tensor([0.25, 1.5]) if env.rank == 0 else torch.tensor([], dtype=torch.float32)
    entropies = gather_tensor(env, share)
    assert entropies.dtype == torch.float32 and entropies.tolist() == [0.25, 1.5], entropies
    assert gather_values(env, []) == []
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
