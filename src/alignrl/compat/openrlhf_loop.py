"""OpenRLHF's `train_ppo_ray` flags of the rollout loop: dynamic filtering (DAPO's dynamic sampling as OpenRLHF
spells it), ring attention and the agent function (--agent_func_path: a multi-turn environment file, alignrl's
agent.env_path, played turn by turn as OpenRLHF's MultiTurnAgentExecutor plays it; `rollout.env_agent`). Their
checks, their alignrl config keys and the ones that change nothing here; `openrlhf_flags` adds them to its parser,
`openrlhf_keys` to its overrides and its start list.

Dynamic filtering keeps a prompt's group when its mean reward lies strictly inside --dynamic_filtering_reward_range
(OpenRLHF's default (0, 1)): algorithm.dynamic_sampling with algorithm.dynamic_sampling_range, the same test. For 0/1
rewards and the range (0, 1) that is DAPO's "rewards differ"; for other ranges and shaped rewards the band is what
decides, as in OpenRLHF.
"""

from __future__ import annotations

from alignrl.config import ConfigError

# OpenRLHF's default band: a group all wrong (mean 0) or all right (mean 1) under a 0/1 reward is dropped
FILTER_RANGE = (0.0, 1.0)
RING_WHY = ("not used here: ring attention splits each sequence over N GPUs to fit long ones in memory; alignrl "
            "keeps a sequence on one GPU and computes the same loss")
REFILL_WHY = ("refills the batch until it is full or a whole pass over the prompts has been drawn for the step "
              "(OpenRLHF stops at the end of its data), then trains on the groups kept, an equal share on each actor "
              "rank")
PENALTY_WHY = ("with --dynamic_filtering a reward that comes without 'scores' is tested after this penalty "
               "(OpenRLHF tests it before)")


class LoopFlagError(ConfigError):
    """A rollout-loop flag alignrl cannot follow or a value OpenRLHF refuses; one line naming it and the fix."""


def add_loop_flags(g) -> None:
    """The flags, OpenRLHF's names, meanings and defaults."""
    g.add_argument("--dynamic_filtering", action="store_true",
                   help="keep only prompt groups whose mean reward is strictly inside --dynamic_filtering_reward_range "
                        "(DAPO's dynamic sampling)")
    g.add_argument("--dynamic_filtering_reward_range", type=float, nargs=2, default=FILTER_RANGE, metavar=("L", "H"),
                   help="the open range (L, H) a group's mean reward must lie in to be kept (default 0 1)")
    g.add_argument("--ring_attn_size", type=int, default=1,
                   help="accepted; ring attention (one sequence over N GPUs) is not used: each GPU holds whole "
                        "sequences")
    g.add_argument("--ring_head_stride", type=int, default=1, help="accepted with --ring_attn_size")
    g.add_argument("--agent_func_path", default=None,
                   help="a Python file defining AgentInstance (async reset() and step()): multi-turn episodes against "
                        "it, its step()s giving the rewards (agent.env_path; docs/agents.md)")


def check_loop(args) -> None:
    """The flags' values, one line each."""
    if args.agent_func_path and getattr(args, "remote_rm_url", None):
        raise LoopFlagError(f"--agent_func_path {args.agent_func_path} gives the rewards (its step()'s 'rewards'): "
                            f"drop --remote_rm_url {args.remote_rm_url}, or drop --agent_func_path to score with it")
    if args.ring_attn_size < 1 or args.ring_head_stride < 1:
        raise LoopFlagError("--ring_attn_size and --ring_head_stride must be at least 1")
    if not args.dynamic_filtering:
        return
    low, high = args.dynamic_filtering_reward_range
    if low >= high:  # OpenRLHF asserts it too: an empty range keeps no group
        raise LoopFlagError(f"--dynamic_filtering_reward_range {low:g} {high:g}: L must be below H (a group is kept "
                            "when its mean reward is strictly between them)")
    if args.n_samples_per_prompt <= 1:
        raise LoopFlagError("--dynamic_filtering compares the samples of a prompt: set --n_samples_per_prompt > 1")


def loop_keys(args) -> list[str]:
    """alignrl config keys of the flags: the environment file, and dynamic filtering as dynamic sampling by the mean
    reward's range. OpenRLHF bounds an episode by its length alone: no turn limit (agent.max_turns=0), each turn
    generating at most what is left of its budget, --prompt_max_len + --generate_max_len less the prompt and the turns
    so far (agent.lend_prompt_room)."""
    keys = ([f"agent.env_path={args.agent_func_path}", "agent.max_turns=0", "agent.lend_prompt_room=true"]
            if args.agent_func_path else [])
    if not args.dynamic_filtering:
        return keys
    low, high = args.dynamic_filtering_reward_range
    return [*keys, "algorithm.dynamic_sampling=true", f"algorithm.dynamic_sampling_range=[{low},{high}]",
            f"algorithm.max_gen_rounds={refill_rounds(args)}"]


def refill_rounds(args) -> int:
    """OpenRLHF refills a filtered batch until it is full or its prompts run out: at most one pass over the prompts a
    step, in --rollout_batch_size draws (the first draw included)."""
    from alignrl.compat.openrlhf_sources import prompt_rows

    return max(1, prompt_rows(args) // args.rollout_batch_size - 1)


def loop_unused(args) -> list[tuple[tuple[str, ...], str]]:
    """(flags, reason) groups of the flags given that change nothing here, or differ: ring attention only when it
    would split sequences (a size of 1 is OpenRLHF's own default, quiet)."""
    out = [(("ring_attn_size", "ring_head_stride") if args.ring_attn_size > 1 else (), RING_WHY),
           (("dynamic_filtering",), REFILL_WHY)]
    if args.dynamic_filtering:
        out.append((("overlong_buffer_len",), PENALTY_WHY))
    return out
