"""The config section of the code reward: where the programs of verl's code sets run, and their limits
(docs/code.md)."""

from __future__ import annotations

from dataclasses import dataclass

from alignrl.config.option import opt


@dataclass(frozen=True)
class SandboxConfig:
    url: str = opt("", "SandboxFusion /run_code URL the code reward's programs run on (`alignrl serve sandbox`, "
                       "or SandboxFusion; verl's reward_model.sandbox_fusion.url); \"\": they run on the scoring "
                       "machine in child processes with resource limits, which do not isolate them")
    max_concurrent: int = opt(0, "test cases of one response that run at once; 0: the cores this process may use, "
                                 "or 64 (verl's reward_model.sandbox_fusion.max_concurrent) with sandbox.url",
                              ge=0)
    memory_limit_mb: int = opt(1024, "address space of one run, MiB (verl's "
                                     "reward_model.sandbox_fusion.memory_limit_mb)", ge=1)
    timeout_s: float = opt(10.0, "seconds one test case may run (verl's 10)", gt=0.0)
