"""An interactive environment in OpenRLHF's agent format (`agent.env_path`, OpenRLHF's `--agent_func_path`): the
policy answers an arithmetic problem with `#### N`; a wrong or missing answer gets one more turn after a hint, for
half the reward. The file imports only torch and OpenRLHF's agent base classes (which alignrl provides when OpenRLHF is
not installed), so the same file runs under OpenRLHF.

    alignrl train grpo --config examples/demo.yaml agent.env_path=examples/envs/retry_arithmetic.py \
        agent.max_response_length=96
"""

import re
from typing import Any

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

ANSWER = re.compile(r"####\s*(-?[\d,]+(?:\.\d+)?)")
HINT = "\nThat is not right. Check each step, then give the answer again as #### N.\n"
TRIES = 2


def answer(text: str) -> str | None:
    """The last `#### N` of the text (as the GSM8K reward reads it), without thousands separators."""
    found = ANSWER.findall(text)
    return found[-1].replace(",", "") if found else None


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.tries = 0

    async def reset(self, states: dict, **kwargs) -> dict:
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> dict[str, Any]:
        self.tries += 1
        right = answer(states["action_text"]) == str(states["label"]).strip()
        done = right or self.tries >= TRIES
        reward = (1.0 if self.tries == 1 else 0.5) if right else 0.0
        return {"rewards": torch.tensor(reward), "scores": torch.tensor(float(right and self.tries == 1)),
                "environment_feedback": "" if done else HINT, "done": done,
                "extra_logs": {"solved_after_hint": torch.tensor(float(right and self.tries > 1))}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
