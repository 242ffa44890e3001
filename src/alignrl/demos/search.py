"""`alignrl demo search`: PPO teaches a tiny model to use a search engine (Search-R1's recipe, end to end).

    alignrl demo search [--seed N] [--heldout N] [--tool-loop] [key.sub=value ...]
    alignrl demo search [--seed N] [--tool-loop] --build-base DIR

Builds (or takes from the cache) the search demo's base model, starts `alignrl serve retrieve` (BM25 over
the demo's corpus of invented facts) on loopback, measures the base model on held-out questions, trains
PPO with a critic through the server (multi-turn rollouts, observation tokens masked out of the loss),
stops the server, and measures the trained model the same way: greedy exact match, search calls per
episode and valid-action rate, before and after. The numbers go to `<run dir>/summary.json`
(`base_exact_match`, `final_exact_match`, `base_searches_per_episode`, ..., `wall_seconds`) beside the
run's curves (`logs/curves.png`); the last line printed holds them. Dotted overrides go on top of
`examples/search_demo.yaml`.

`--tool-loop` plays the same world through verl's tool agent loop instead (`agent.tool_config_path`): its own base
model (SFT'd on the loop's chat text, `demos.search_tools`), verl's Search-R1-like rows (`searchR1_nq`), a tool
config naming verl's SearchTool at the server (written into the run folder), `examples/search_tools_demo.yaml`;
searches per episode count the tool calls, and a turn with a `<tool_call>` that does not parse is not a valid action.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from alignrl.config import ConfigError, RunConfig, load_config
from alignrl.demos.common import check_overrides, raise_on_sigterm
from alignrl.demos.search_data import DATA_DIR, TEST_FILE, TRAIN_FILE, CORPUS_FILE, write_data
from alignrl.demos.search_model import SearchRecipe, demo_recipe, ensure_search_model

PROG = "alignrl demo search"
CONFIG = Path(__file__).resolve().parent.parent / "examples" / "search_demo.yaml"
TOOLS_CONFIG = CONFIG.parent / "search_tools_demo.yaml"  # --tool-loop
SHIPPED_SEED = 0  # the world whose corpus and questions ship in demos/data


def demo_files(seed: int, run_dir: Path) -> dict[str, Path]:
    """Corpus and question files of the world of `seed`: the shipped ones, or written into the run folder."""
    if seed == SHIPPED_SEED:
        files = {"corpus": DATA_DIR / CORPUS_FILE, "train": DATA_DIR / TRAIN_FILE, "test": DATA_DIR / TEST_FILE}
        missing = [str(p) for p in files.values() if not p.is_file()]
        if missing:
            from alignrl.data.loaders import DataError

            raise DataError(f"the search demo's shipped data file {missing[0]} is missing (reinstall alignrl, "
                            f"or pass --seed 1 to generate a world into the run folder)")
        return files
    return write_data(run_dir / "data", seed)


def retrieval_server(corpus: Path, topk: int):
    """`alignrl serve retrieve` with BM25 over `corpus` on a free loopback port, started and healthy; the
    caller stops it (by PID) in a `finally`."""
    from alignrl.rollout.remote import ServiceError
    from alignrl.serve.process import ServiceProcess

    server = ServiceProcess(["retrieve", "--corpus_path", str(corpus), "--retriever_name", "bm25",
                             "--topk", str(topk)], startup_s=60.0)
    try:
        return server.start()
    except RuntimeError as e:
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        raise ServiceError(f"the search demo's retrieval server did not start: {lines[-1] if lines else e}") from None


def agent_eval(model_path: str, cfg: RunConfig, samples: Sequence, batch_size: int = 150) -> dict[str, float]:
    """Greedy multi-turn episodes on `samples` through the configured retriever, as training rolls out:
    exact match (the task's reward), search calls per episode and the share of turns with a valid action."""
    from alignrl.placements.episodes import with_tools
    from alignrl.data.collate import encode_prompts
    from alignrl.interfaces import SamplingParams
    from alignrl.models.loader import load_model
    from alignrl.rewards.registry import load_reward_fn
    from alignrl.rl.evaluate import rule_correct
    from alignrl.rollout.env_agent import with_labels
    from alignrl.rollout.hf_engine import HFRolloutEngine
    from alignrl.rollout.verl_tools import tool_schemas

    model, tokenizer = load_model(model_path, cfg.model.dtype, log=lambda *_: None)
    engine = with_tools(cfg, HFRolloutEngine(model.eval(), tokenizer), tokenizer)
    correct_fn = load_reward_fn(cfg.algorithm.reward_fn)
    # as the run templates and hands them over: with the tool config's schemas, and each row for the tool loop
    prompts = with_labels(engine, samples, encode_prompts(tokenizer, samples, cfg.data.max_prompt_length,
                                                          tools=tool_schemas(cfg.agent.tool_config_path)))
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens)
    correct, searches, valid, actions = 0, 0.0, 0.0, 0.0
    try:
        for start in range(0, len(samples), batch_size):
            ro = engine.generate(prompts[start:start + batch_size], params)
            texts = tokenizer.batch_decode(ro.response_ids.masked_fill(~ro.response_mask, tokenizer.pad_token_id),
                                           skip_special_tokens=True)
            correct += sum(rule_correct(tokenizer, ro, texts, samples[start:start + batch_size], start, correct_fn, 1))
            got = _tool_use(ro.stats)
            searches, valid, actions = searches + got[0], valid + got[1], actions + got[2]
    finally:
        if getattr(engine, "tool", None) is not None:
            engine.tool.close()
    n = max(1, len(samples))
    return {"exact_match": round(correct / n, 4), "searches_per_episode": round(searches / n, 4),
            "valid_action_rate": round(valid / max(1.0, actions), 4)}


def _tool_use(stats) -> tuple[float, float, float]:
    """A batch's searches, valid actions and actions: Search-R1's agent counts them; in verl's tool loop a search is
    a tool call, an action a turn, and a turn is invalid when one of its <tool_call> blocks does not parse."""
    if not stats:  # a plain engine (agent.max_turns=0) counts no tool use: zeros
        return 0.0, 0.0, 0.0
    if "env/tool_calls" in stats:
        turns = float(stats["turns"].sum())
        return (float(stats["env/tool_calls"].nansum()), turns - float(stats["env/tool_call_parse_errors"].nansum()),
                turns)
    return float(stats["searches"].sum()), float(stats["valid_actions"].sum()), float(stats["actions"].sum())


def run(recipe: SearchRecipe, overrides: Sequence[str], heldout: int, log=print) -> dict:
    """The whole demo; returns the summary (also written to `<run dir>/summary.json`)."""
    from alignrl.runner import train_grpo
    from alignrl.data.loaders import load_samples
    from alignrl.utils.atomic import atomic_write_text

    t0 = time.time()
    tools = recipe.loop == "tool"
    config = TOOLS_CONFIG if tools else CONFIG
    load_config(config, list(overrides))  # a bad override fails here, before minutes of model building
    model = ensure_search_model(recipe, log)
    run_dir = load_config(config, list(overrides)).run_dir
    files = demo_files(recipe.seed, run_dir)
    if tools:  # the same questions as verl's Search-R1-like rows
        from alignrl.demos.search_data import build_world
        from alignrl.demos.search_tools import write_tool_data

        files.update(write_tool_data(run_dir / "data", build_world(recipe.seed)))
    settings = [f"model.path={model}", f"data.train_files={files['train']}", f"data.val_files={files['test']}",
                *overrides]
    retriever = load_config(config, settings).retriever
    heldout_set = load_samples(str(files["test"]), limit=heldout, key="data.val_files")
    server = retrieval_server(files["corpus"], retriever.topk)
    try:
        if tools:
            from alignrl.demos.search_tools import TOOL_CONFIG_FILE, write_tool_config

            path = write_tool_config(run_dir / TOOL_CONFIG_FILE, f"{server.url}/retrieve", retriever.topk,
                                     retriever.timeout_s)
            cfg = load_config(config, [*settings, f"agent.tool_config_path={path}"])
        else:
            cfg = load_config(config, [*settings, f"retriever.url={server.url}/retrieve"])
        log(f"retrieval server {server.url} (BM25 over {files['corpus'].name}, pid {server.proc.pid}); "
            f"measuring the base model on {len(heldout_set)} held-out questions")
        base = agent_eval(str(model), cfg, heldout_set)
        log("base model: " + _line(base))
        summary = train_grpo(cfg, wall_start=t0)
        final_model = cfg.checkpoint_root / f"global_step_{cfg.trainer.total_training_steps}" / "model"
        final = agent_eval(str(final_model), cfg, heldout_set)
        log("trained model: " + _line(final))
    finally:
        server.stop()
    summary.update({f"{when}_{k}": v for when, m in (("base", base), ("final", final)) for k, v in m.items()})
    summary.update(loop="verl_tool_agent_loop" if tools else "search_r1_agent",
                   exact_match_gain_points=round(100 * (final["exact_match"] - base["exact_match"]), 2),
                   heldout_questions=len(heldout_set), base_model=str(model),
                   curves=str(cfg.log_root / "curves.png"), wall_seconds=round(time.time() - t0, 1))
    atomic_write_text(cfg.run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def _line(m: dict[str, float]) -> str:
    return (f"exact match {m['exact_match']:.3f}, {m['searches_per_episode']:.2f} searches/episode, "
            f"valid-action rate {m['valid_action_rate']:.3f}")


def _parser():
    from alignrl.runtime.one_line import OneLineParser

    p = OneLineParser(prog=PROG, description="PPO teaches a tiny model to search (Search-R1's recipe, on CPU).")
    p.add_argument("--seed", type=int, default=SHIPPED_SEED, help="seed of the demo world and base model")
    p.add_argument("--heldout", type=int, default=300, help="held-out questions measured before and after")
    p.add_argument("--tool-loop", action="store_true",
                   help="play it through verl's tool agent loop and verl's SearchTool (agent.tool_config_path), with "
                        "its own base model and examples/search_tools_demo.yaml")
    p.add_argument("--build-base", metavar="DIR", default=None,
                   help="only (re)build the base model of --seed (and --tool-loop) into DIR from its seed, then exit "
                        "(the shipped ones are src/alignrl/demos/search_base and search_tools_base)")
    p.add_argument("overrides", nargs="*", help="dotted overrides on top of examples/search_demo.yaml "
                                                "(search_tools_demo.yaml with --tool-loop)")
    return p


def main(argv: list[str] | None = None) -> int:
    args, rest = _parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    check_overrides(PROG, rest, "--seed, --heldout, --tool-loop and key.sub=value overrides")
    if args.heldout < 1:
        raise ConfigError(f"--heldout must be at least 1, got {args.heldout}")
    raise_on_sigterm()  # the retrieval server is stopped by its PID in a `finally`, on a kill too
    recipe = demo_recipe(args.seed, "tool" if args.tool_loop else "search_r1")
    if args.build_base:
        from alignrl.demos.search_model import build_search_model

        if args.overrides or rest:
            raise ConfigError("--build-base takes only --seed and --tool-loop (the base model's recipe has no "
                              "overrides)")
        build_search_model(Path(args.build_base), recipe)
        return 0
    s = run(recipe, [*args.overrides, *rest], args.heldout)
    print(f"base_exact_match={s['base_exact_match']:.3f} final_exact_match={s['final_exact_match']:.3f} "
          f"gain={s['exact_match_gain_points']:+.1f} points "
          f"searches/episode={s['base_searches_per_episode']:.2f}->{s['final_searches_per_episode']:.2f} "
          f"valid_action_rate={s['base_valid_action_rate']:.3f}->{s['final_valid_action_rate']:.3f} "
          f"steps={s['steps']} loop={s['loop']} wall_seconds={s['wall_seconds']:.0f}")
    return 0
