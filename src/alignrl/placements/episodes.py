"""The shape of a run's rollouts over its engine: single answers, episodes against an environment (agent.env_path),
verl's tool loop (agent.tool_config_path, agent.interaction_config_path) or the multi-turn search agent
(agent.max_turns with the retriever)."""

from __future__ import annotations

from alignrl.config import RunConfig
from alignrl.config.checks import response_cap
from alignrl.interfaces import RolloutEngine
from alignrl.rollout.retriever import RetrieverClient
from alignrl.rollout.agent import AgentRollout
from alignrl.rollout.env_agent import EnvRollout
from alignrl.rollout.environments import load_environment


def run_tool_schemas(cfg: RunConfig) -> list[dict] | None:
    """verl's tool schemas of agent.tool_config_path, None without one: the tool loop is imported only then (its
    pydantic models are a quarter of a second of a process's start)."""
    if not cfg.agent.tool_config_path:
        return None
    from alignrl.rollout.verl_tools import tool_schemas

    return tool_schemas(cfg.agent.tool_config_path)


def with_tools(cfg: RunConfig, engine: RolloutEngine, tokenizer) -> RolloutEngine:
    """The episodes against the environment of agent.env_path or verl's tool loop of agent.tool_config_path (and
    agent.interaction_config_path) over
    `engine`, else the multi-turn search rollout when agent.max_turns > 0, else `engine` itself (the config's checks
    refused the combinations that cannot work: `config.agent_checks`)."""
    a = cfg.agent
    if a.env_path:
        return EnvRollout(engine, tokenizer, load_environment(a.env_path), response_cap(cfg), a.max_turns,
                          prompt_room=cfg.data.max_prompt_length if a.lend_prompt_room else 0)
    if a.tool_config_path or a.interaction_config_path:  # verl's tool agent loop, agent.max_turns its
        # max_assistant_turns; its tools, its interactions (a simulated user) or both
        from alignrl.rollout.verl_tools import ToolLoop, tool_environment
        loop = ToolLoop(a.max_turns, a.max_user_turns, a.max_parallel_calls, a.max_tool_response_length,
                        a.tool_response_truncate_side, a.tool_format)
        make = tool_environment(a.tool_config_path, tokenizer, loop, a.interaction_config_path)
        return EnvRollout(engine, tokenizer, make, response_cap(cfg), a.max_turns)
    if a.max_turns == 0:
        return engine
    r, d = cfg.retriever, cfg.data
    tool = RetrieverClient(r.url, r.topk, r.timeout_s, r.retries) if a.search else None
    if tool is not None:
        tool.check()
    return AgentRollout(engine, tokenizer, tool, a.max_turns, d.max_obs_length,
                        d.max_start_length or d.max_prompt_length, response_cap(cfg))
