"""The config sections about where the work runs and what it calls: services, the ZeroMQ pipeline, multi-turn
tools and their retriever."""

from __future__ import annotations

from dataclasses import dataclass

from alignrl.config.option import opt


@dataclass(frozen=True)
class ServicesConfig:
    generation_url: str = opt("", "`alignrl serve generate` URL: rollouts are generated there and new weights are "
                                  "pushed to it after every step (seed layout: training.services.generation.url)")
    reference_url: str = opt("", "`alignrl serve ref` URL for reference log-probs (training.services.reference.url)")
    reward_url: str = opt("", "`alignrl serve reward` URL: its score is the reward (training.services.reward.url); "
                              "an OpenRLHF-style endpoint (http://host:5000/get_reward); several, comma-separated, "
                              "share each batch in contiguous shards (OpenRLHF's --remote_rm_url a,b)")
    timeout_s: float = opt(300.0, "per-request timeout of service clients, seconds", gt=0.0)
    retries: int = opt(3, "tries per request before a service counts as down (exponential backoff)", ge=1)
    wait_s: float = opt(30.0, "seconds a run waits at its start for a configured service that does not answer "
                              "yet (one still loading its model)", ge=0.0)


@dataclass(frozen=True)
class PipelineConfig:
    placement: str = opt("inline", "inline: rollouts are made in the trainer's processes; zmq: sampler processes "
                                   "(`alignrl sample`, sampling_worker.py) make them and stream them in",
                         choices=("inline", "zmq"))
    host: str = opt("127.0.0.1", "zmq: the trainer binds here and samplers connect here; a non-loopback host "
                                 "needs ALIGNRL_ZMQ_TOKEN set on both sides")
    data_port: int = opt(5555, "zmq: samplers PUSH scored batches to this port (--data-port)", ge=1,
                         le=65535)
    sync_port: int = opt(5556, "zmq: weights and work go out on this port (--sync-port)", ge=1, le=65535)
    max_staleness: int = opt(0, "zmq: train only on batches made with weights at most this many versions old; "
                                "0 is strictly on-policy", ge=0)
    lease_timeout_s: float = opt(600.0, "zmq: prompts handed to a sampler that sends no batch in this time go "
                                        "to another sampler", gt=0.0)
    heartbeat_timeout_s: float = opt(20.0, "zmq: prompts leased to a sampler process the trainer has not heard from "
                                            "(samplers signal every second, also while they generate) in this "
                                            "time go to another sampler: a killed sampler's prompts are made "
                                            "again within seconds, not after lease_timeout_s", gt=0.0)
    peer_timeout_s: float = opt(600.0, "zmq: the trainer waits this long for a batch, a sampler this long for the "
                                       "trainer, before stopping with a one-line error", gt=0.0)
    hwm: int = opt(2, "zmq: batches queued per socket at most (bounds memory)", ge=1)
    bucket_mb: int = opt(32, "zmq: weight frames (and shared weight buffers) of about this size", ge=1)
    weight_transport: str = opt("auto", "zmq: how samplers receive new weights: zmq (bucket frames on the sync port), "
                                        "shared (memory they map on the trainer's host: CUDA IPC for a trainer on a "
                                        "GPU, which then keeps up to 3 copies of the weights there; POSIX shared "
                                        "memory for one on the CPU), or auto (shared for the samplers that can map "
                                        "it, frames for the others)", choices=("auto", "zmq", "shared"))
    ref_logprobs: str = opt("sampler", "zmq: who runs the frozen reference forward of a KL term: sampler (all of it, "
                                       "as the sampler does), trainer (all of it; samplers hold no reference model), or "
                                       "balance (with max_staleness >= 1, split by prompt groups toward the side that "
                                       "waits; with max_staleness=0, as sampler)",
                            choices=("sampler", "trainer", "balance"))
    lend_cores: bool = opt(True, "zmq, a one-process trainer on the CPU: while samplers on its machine wait, it trains "
                                 "with their threads too, and on policy (max_staleness=0) samplers generate with the "
                                 "trainer's; float sums may then round differently, so runs are not guaranteed "
                                 "bit-repeatable (false: each process keeps its own threads)")
    replay_buffer_size: int = opt(0, "prompt groups with reward spread kept on the trainer side to replay in later "
                                     "batches in place of groups without it (their rewards all equal); 0: no "
                                     "replay. Replayed groups are off-policy: needs algorithm.rollout_is and "
                                     "actor.recompute_old_logprobs (--replay-buffer-size)", ge=0)
    replay_share: float = opt(0.0, "with a replay buffer: the share of every batch's groups (the ones without reward "
                                   "spread first, then the lowest spread) replaced by stored groups", ge=0.0, le=1.0)


@dataclass(frozen=True)
class AgentConfig:
    max_turns: int = opt(0, "multi-turn tool use (Search-R1): turns that may call the tool before a last turn "
                            "without it; 0 is single-turn generation (Search-R1's max_turns). With agent.env_path "
                            "or verl's tool loop (agent.tool_config_path, agent.interaction_config_path): the most "
                            "assistant turns of an episode, 0 for no limit (verl's "
                            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns)", ge=0)
    search: bool = opt(True, "multi-turn: <search>query</search> calls retriever.url (Search-R1's do_search)")
    max_response_length: int = opt(0, "multi-turn: tokens of one episode's whole response, generated and "
                                      "observation tokens together; the episode is cut there, and the overlong "
                                      "penalty and seq-mean-token-sum-norm use it. 0: the most the turns can "
                                      "produce, (max_turns+1) x rollout.max_new_tokens + max_turns x "
                                      "data.max_obs_length (verl's actor_rollout_ref.rollout.response_length; "
                                      "a Search-R1 command line gets its data.max_prompt_length); with "
                                      "agent.env_path or verl's tool loop: the episode's cap, 0 meaning "
                                      "rollout.max_new_tokens", ge=0)
    env_path: str = opt("", "a Python file defining an interactive environment in OpenRLHF's agent format (class "
                            "AgentInstance with async reset() and step(); OpenRLHF's --agent_func_path): episodes "
                            "run turn by turn against it and its step()s give the rewards; agent.max_turns then "
                            "bounds the turns (0: until it says done or the response cap is reached). docs/agents.md")
    tool_config_path: str = opt("", "verl's tool config YAML (tools: [{class_name, config, tool_schema}]; verl's "
                                    "actor_rollout_ref.rollout.multi_turn.tool_config_path): episodes run verl's tool "
                                    "agent loop, the prompt templated with the tools' schemas, each turn's tool calls "
                                    "answered by the tools, the reward function scoring the whole response; \"\": "
                                    "off. docs/agents.md")
    interaction_config_path: str = opt("", "verl's interaction config YAML (interaction: [{name, class_name, config}]; "
                                           "verl's actor_rollout_ref.rollout.multi_turn.interaction_config_path): "
                                           "episodes run verl's tool agent loop with a simulated user, the interaction "
                                           "a row's extra_info.interaction_kwargs.name picks answering each assistant "
                                           "turn without tool calls as a user message until it ends the episode; the "
                                           "reward function scores the whole response; \"\": off. docs/agents.md")
    lend_prompt_room: bool = opt(False, "with agent.env_path: a prompt shorter than data.max_prompt_length lends its "
                                        "unused length to the episode's response, whose turns may then run past the "
                                        "response cap, as OpenRLHF budgets an episode prompt_max_len + "
                                        "generate_max_len in all (set by --agent_func_path)")
    tool_format: str = opt("hermes", "the tool-call format parsed from each turn: hermes, <tool_call>{\"name\": ..., "
                                     "\"arguments\": ...}</tool_call> (verl's multi_turn.format)", choices=("hermes",))
    max_user_turns: int = opt(0, "in verl's tool loop: the most tool-response and interaction-reply turns of an "
                                 "episode, 0 for no limit (verl's multi_turn.max_user_turns)", ge=0)
    max_parallel_calls: int = opt(1, "with agent.tool_config_path: tool calls of one turn that run (concurrently); "
                                     "later ones are dropped (verl's multi_turn.max_parallel_calls)", ge=1)
    max_tool_response_length: int = opt(256, "with agent.tool_config_path: characters of a tool's response kept, "
                                             "the rest cut (verl's multi_turn.max_tool_response_length)", ge=1)
    tool_response_truncate_side: str = opt("middle", "with agent.tool_config_path: which part of a long tool response "
                                                     "is kept: left (its start), right (its end) or middle (both "
                                                     "ends) (verl's multi_turn.tool_response_truncate_side)",
                                           choices=("left", "middle", "right"))


@dataclass(frozen=True)
class RetrieverConfig:
    url: str = opt("http://127.0.0.1:8000/retrieve", "retrieval server of multi-turn search (`alignrl serve "
                                                     "retrieve`, Search-R1's retriever.url)")
    topk: int = opt(3, "passages per search (Search-R1's retriever.topk)", ge=1)
    timeout_s: float = opt(30.0, "per-request timeout of the retriever, seconds", gt=0.0)
    retries: int = opt(3, "tries per request before the retriever counts as down", ge=1)
