"""The multi-turn settings that cannot work together (an environment, verl's tool loop and its interactions,
Search-R1's search agent), checked when the config loads (`checks.check_combinations`)."""

from __future__ import annotations

from alignrl.config.placement_schema import AgentConfig
from alignrl.config.schema import RunConfig


def verl_tool_loop(agent: AgentConfig) -> bool:
    """Whether the episodes run verl's tool agent loop: a tool config, an interaction config, or both."""
    return bool(agent.tool_config_path or agent.interaction_config_path)


def needs_chat_template(cfg: RunConfig) -> bool:
    """Whether the run renders anything through the tokenizer's chat template: its prompts (data.apply_chat_template)
    or the turns of a multi-turn rollout. Without either, a model whose tokenizer has none trains on plain text."""
    a = cfg.agent
    return bool(cfg.data.apply_chat_template or a.env_path or verl_tool_loop(a) or a.max_turns)


def multi_turn_problem(cfg: RunConfig) -> str | None:
    """Multi-turn rollouts (an environment, verl's tool loop, Search-R1's search): one of them runs the turns; an
    environment gives the rewards, so a reward model beside it would be ignored; and what the turns append (feedback,
    tool responses, an interaction's replies, search results) has no rollout log-probs, so training on it needs them
    recomputed."""
    a = cfg.agent
    for key in ("tool_config_path", "interaction_config_path"):
        if a.env_path and getattr(a, key):
            return (f"agent.env_path and agent.{key} each run the episodes: give one of them (an OpenRLHF "
                    "environment file, or verl's tool loop with its tool or interaction config YAML)")
    scorer = (cfg.algorithm.reward_model and "algorithm.reward_model") or (cfg.services.reward_url and
                                                                            "services.reward_url")
    if scorer and a.env_path:
        return (f"agent.env_path={a.env_path} gives the rewards (its step()'s 'rewards'): drop {scorer}, or drop "
                "agent.env_path to score with it")
    if a.lend_prompt_room and not a.env_path:
        return ("agent.lend_prompt_room lends a short prompt's length to an environment's episode: set "
                "agent.env_path, or drop agent.lend_prompt_room")
    turns = a.env_path or verl_tool_loop(a) or a.max_turns
    if turns and not cfg.actor.state_masking and not cfg.actor.recompute_old_logprobs:
        return ("actor.state_masking=false trains on what the turns append (tool observations, an environment's "
                "feedback, an interaction's replies), which has no rollout log-probs: set "
                "actor.recompute_old_logprobs=true (or keep actor.state_masking=true)")
    return None
