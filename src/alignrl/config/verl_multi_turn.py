"""verl's multi-turn rollout keys (actor_rollout_ref.rollout.multi_turn.*, rollout.agent.*) as alignrl's agent.* keys:
verl's tool agent loop is alignrl's agent.tool_config_path (`rollout.verl_tools`), its interactions (a simulated user)
agent.interaction_config_path (`rollout.verl_interactions`).

`multi_turn.enable` and the agent loop's name only choose verl's loop; the tool and interaction configs are what make
the episodes multi-turn, here as in verl (its tool loop with neither ends after the first turn). verl's null turn
limits are alignrl's 0 (no limit)."""

from __future__ import annotations

from alignrl.config.schema import ConfigError
from alignrl.config.verl_pass import TranslationPass
from alignrl.config.verl_tables import R

M = R + "multi_turn."
# verl's key -> alignrl's; a null turn limit is no limit (0)
KEYS = {M + "tool_config_path": "agent.tool_config_path",
        M + "interaction_config_path": "agent.interaction_config_path", M + "max_assistant_turns": "agent.max_turns",
        M + "max_user_turns": "agent.max_user_turns", M + "max_parallel_calls": "agent.max_parallel_calls",
        M + "max_tool_response_length": "agent.max_tool_response_length",
        M + "tool_response_truncate_side": "agent.tool_response_truncate_side", M + "format": "agent.tool_format",
        M + "max_turns": "agent.max_turns"}  # verl 0.4's name of max_assistant_turns (its geo3k example's config)
# old names of a key above: unset, they say nothing (a null would undo the current name's limit, given in any order)
ALIASES = (M + "max_turns",)
# the config files: unset is off, not a number
PATHS = ("agent.tool_config_path", "agent.interaction_config_path")
# accepted quietly: they choose verl's loop, and the tool and interaction configs make the episodes multi-turn
QUIET = (M + "enable", R + "agent.default_agent_loop")
# accepted and listed as not used: the chat-template and tokenization checks guard verl's re-tokenizing (alignrl
# keeps each turn's ids as generated and appends tool responses in the template's form); each prompt's rollout.n
# episodes are played once
NOT_USED = (M + "use_inference_chat_template", M + "tokenization_sanity_check_mode", M + "num_repeat_rollouts")
# accepted only unset: (what verl would run, what to do instead)
REFUSED = {M + "function_tool_path": "Python function tools are not supported; give them as a tool config YAML "
                                     "(multi_turn.tool_config_path) of BaseTool classes",
           R + "agent.agent_loop_config_path": "custom agent loops are not supported; alignrl runs verl's tool loop "
                                               "(multi_turn.tool_config_path) or an OpenRLHF agent file "
                                               "(agent.env_path)"}


# verl 0.4's names of the hermes call format: its examples for Qwen models say `format: qwen` (Qwen's template
# writes hermes <tool_call> JSON), and its default was chatml
HERMES_ALIASES = ("qwen", "chatml")


def multi_turn(st: TranslationPass, key: str, value: str) -> bool:
    """One multi-turn key translated into `st`; False: not one of them."""
    unset = value.strip().lower() in ("null", "none", "~", "")
    if key == M + "format" and value.strip("'\"").lower() in HERMES_ALIASES:
        st.out.append("agent.tool_format=hermes")
    elif key in KEYS:
        target = KEYS[key]
        if not unset:
            st.out.append(f"{target}={value}")
        elif target not in PATHS and key not in ALIASES:
            st.out.append(f"{target}=0")  # verl's null: no limit
    elif key in NOT_USED or key in QUIET:
        if key in NOT_USED and key not in st.not_used:
            st.not_used.append(key)
    elif key in REFUSED:
        if not unset:
            raise ConfigError(f"{key}={value}: {REFUSED[key]}")
    else:
        return False
    st.verl = True
    return True
