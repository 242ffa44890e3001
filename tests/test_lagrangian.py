"""PPO-Lagrangian pieces with hand-worked values."""

import pytest
import torch

from alignrl.core.lagrangian import LagrangeMultiplier, safe_advantages


def test_safe_advantage_hand_worked():
    # lambda = 1: (A_r - A_c) / 2 -> (1 - 3) / 2 = -1 and (2 - 0) / 2 = 1
    out = safe_advantages(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 0.0]), 1.0)
    assert out.tolist() == [-1.0, 1.0]
    # lambda = 0 leaves the reward advantage unchanged
    assert safe_advantages(torch.tensor([0.5]), torch.tensor([9.0]), 0.0).item() == 0.5


def test_multiplier_ascends_on_violation_and_projects_at_zero():
    lam = LagrangeMultiplier(init=0.0, lr=0.5, threshold=0.2)
    assert lam.update(0.6) == pytest.approx(0.2)  # 0 + 0.5 * (0.6 - 0.2)
    assert lam.update(0.0) == pytest.approx(0.1)  # 0.2 + 0.5 * (0.0 - 0.2)
    assert lam.update(0.0) == 0.0  # 0.1 - 0.1 = 0.0
    assert lam.update(0.0) == 0.0  # projected: never negative
    lam.load_state_dict({"value": 3.0})
    assert lam.state_dict() == {"value": 3.0}
