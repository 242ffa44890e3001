"""The `alignrl` command.

    alignrl train grpo [--config FILE] [key.sub=value ...]
    alignrl demo [key.sub=value ...]
    alignrl build-demo-model [--seed N]
    alignrl config [--config FILE] [overrides] | alignrl config --reference
    alignrl train rm|dpo|sft|kto|kd|prm|opd|online-dpo ... (RM, DPO family, SFT, KTO, KD, PRM, OPD, online DPO)
    alignrl serve generate|ref|reward|retrieve ... (HTTP services: their own flags)
    alignrl doctor [--config FILE]
    alignrl sample --data-port 5555 --sync-port 5556 ... (a sampler for `train grpo pipeline.placement=zmq`)

Any command takes `--nproc N` to run itself on N local ranks under torchrun, forked from this process after it
imports RANK_IMPORTS once for all of them (runtime.forked_ranks). Dotted overrides may come before or after flags.

User errors (config, data, model path, reward spec, flags) print one line (no traceback, no usage block) and exit 2;
under torchrun only rank 0 prints it. `--nproc N` checks the config, the batch split and the data files first.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from alignrl.config import ConfigError, RunConfig, check_folders, check_world_size, keys_given, load_config
from alignrl.config.verl_hydra import SELECTION_FLAGS
from alignrl.runtime.flag_file import config_at
from alignrl.runtime.heap import starting
from alignrl.runtime.one_line import OneLineParser
from alignrl.errors import Terminated, UserError, in_flag_words, program, stop_on_sigterm

EXAMPLES = Path(__file__).parent / "examples"
# Both run the one RL loop; `ppo` (verl's main_ppo) takes any algorithm.adv_estimator from the config,
# `grpo` is the same loop under the name GRPO users type (its default estimator is grpo).
ALGORITHMS = {"grpo": "GRPO / Dr.GRPO: group-relative policy optimisation",
              "ppo": "the RL loop with any algorithm.adv_estimator (grpo, rloo, reinforce_plus_plus, ...)"}

# Commands with flags of their own (the seeds' names): `alignrl <words> ...` runs `module.main(rest)` (or the
# function a "module:function" entry names).
PASSTHROUGH = {
    ("train", "rm"): ("alignrl.preference.cli:rm_main",
                      "train a reward or cost model (Bradley-Terry, Safe RLHF cost)"),
    ("train", "dpo"): ("alignrl.preference.cli:dpo_main", "DPO, IPO, conservative DPO, hinge, safety-aware DPO"),
    ("train", "sft"): ("alignrl.preference.sft_cli:sft_main", "supervised fine-tuning: chats, prompt-completion, text"),
    ("train", "kto"): ("alignrl.preference.kto_cli:kto_main", "KTO on completions labelled desirable or not"),
    ("train", "kd"): ("alignrl.preference.kd_cli:kd_main", "SFT with a teacher's token distributions (distillation)"),
    ("train", "prm"): ("alignrl.preference.prm_cli:prm_main", "process reward model: a label for each step"),
    ("train", "opd"): ("alignrl.compat.openrlhf_opd", "on-policy distillation (OpenRLHF's train_opd flags)"),
    ("train", "online-dpo"): ("alignrl.compat.trl_online_dpo", "online DPO with TRL's flags"),
    ("train", "online_dpo"): ("alignrl.compat.trl_online_dpo", "online DPO, as online-dpo"),
    ("train", "xpo"): ("alignrl.compat.trl_online_dpo:xpo_main", "XPO with TRL's flags: online DPO beside the base"),
    ("train", "nash-md"): ("alignrl.compat.trl_online_dpo:nash_md_main", "Nash-MD with TRL's flags"),
    ("train", "nash_md"): ("alignrl.compat.trl_online_dpo:nash_md_main", "Nash-MD, as nash-md"),
    ("train", "rloo"): ("alignrl.compat.trl_rloo", "RLOO with TRL's `trl rloo` flags"),
    ("train", "ppo-ray"): ("alignrl.compat.openrlhf_ppo_ray", "PPO/GRPO on a Ray cluster with OpenRLHF's flags"),
    ("demo", "search"): ("alignrl.demos.search", "PPO teaches a tiny model to search (Search-R1 recipe, CPU)"),
    ("demo", "safe"): ("alignrl.demos.safe", "Safe-MM-DPO with LoRA makes a tiny model refuse harm, helpfulness kept"),
    ("demo", "vision"): ("alignrl.demos.vision", "RLOO teaches a tiny vision-language model to count in pictures (CPU)"),
    ("eval", "safety"): ("alignrl.preference.safety_eval", "safety rate and helpfulness on held-out prompts"),
    ("serve", "generate"): ("alignrl.serve.generate", "OpenAI-compatible generation server with weight sync"),
    ("serve", "ref"): ("alignrl.serve.ref", "reference-model log-prob server"),
    ("serve", "reward"): ("alignrl.serve.reward", "reward-model scoring server"),
    ("serve", "retrieve"): ("alignrl.serve.retrieve", "retrieval server (Search-R1 API), BM25 or dense"),
    ("serve", "sandbox"): ("alignrl.serve.sandbox", "runs code for rewards and tools (SandboxFusion's /run_code)"),
    ("doctor",): ("alignrl.doctor", "check configured services, model paths, hostfile and ports"),
    ("sample",): ("alignrl.compat.zmq_pipeline:sample_main", "a sampler of the ZeroMQ pipeline (sampling_worker.py)"),
}

# TRL's `trl grpo` flags on `train grpo`: translated into overrides before anything else reads the line (a module of
# the layer above, imported by name as the PASSTHROUGH commands are)
TRL_GRPO, TRL_CONFIG_FILE = "alignrl.compat.trl_grpo_keys", "alignrl.compat.trl_config_file"


def _in_alignrl_words(argv: list[str]) -> list[str]:
    """A `train grpo` line in TRL's spelling as alignrl's key=value overrides, its start lines said once (by rank 0
    of a raw torchrun launch; `--nproc` ranks get the translated line); any other line as it is."""
    at = _first_positional(argv, 1) if argv[:1] == ["train"] else None
    if at is None or argv[at] != "grpo":
        return argv
    argv = ["train", "grpo", *argv[1:at], *argv[at + 1:]]  # `train --config grpo.yaml grpo`: the word first
    import importlib

    trl, recipe = importlib.import_module(TRL_GRPO), importlib.import_module(TRL_CONFIG_FILE)
    from_file = recipe.expand(argv[2:])  # `--config grpo.yaml` of TRL's keys
    if from_file is None and not trl.F.is_trl_line(argv[2:]):
        return argv
    try:
        words, lines = trl.from_line(argv[2:] if from_file is None else from_file)
    except ConfigError as e:  # a value of the file's: say where it came from
        if from_file is None:
            raise
        raise ConfigError(f"{e}; the settings of --config {config_at(argv[2:])[2]} are read as TRL's "
                          "flags") from None
    if os.environ.get("RANK", "0") == "0":
        for line in lines:
            print(f"{program()}: {line}", file=sys.stderr, flush=True)
    return ["train", "grpo", *words]


RANK_IMPORTS = ("alignrl.runner",)  # what an RL rank imports before its work starts
NPROC_HELP = "run on N local ranks under torchrun (torchrun --nproc_per_node=N -m alignrl ... works as well)"


def _passthrough(argv: list[str]) -> tuple[str, list[str]] | None:
    for words, (module, _) in PASSTHROUGH.items():
        if tuple(argv[:len(words)]) == words:
            return module, argv[len(words):]
    if argv[:1] in (["train"], ["demo"]):  # `alignrl train --config x.yaml dpo ...`: the word after the flags
        i = _first_positional(argv, 1)
        if i is not None and (argv[0], argv[i]) in PASSTHROUGH:
            return PASSTHROUGH[(argv[0], argv[i])][0], argv[1:i] + argv[i + 1:]
    return None


def _first_positional(argv: list[str], start: int) -> int | None:
    """Where the first word that is neither a flag, a flag's value nor a key=value override is."""
    i = start
    while i < len(argv):
        word = argv[i]
        if word.startswith("-"):  # Hydra's -cn/-cp/-cd too (verl_hydra): the value is the next word
            i += 2 if word in ("--config", "--nproc", *SELECTION_FLAGS) else 1
        elif "=" in word:
            i += 1
        else:
            return i
    return None


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="alignrl", description="RL post-training of language models.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    own_flags = "; each of rm, dpo, sft, kto, kd, prm, opd, online-dpo and ppo-ray has its own --help"
    train = sub.add_parser("train", help="train a model with an RL algorithm")
    offline = ["dpo", "rm", "sft", "kto", "kd", "prm", "opd", "online-dpo", "ppo-ray"]
    train.add_argument("algorithm", choices=sorted(ALGORITHMS) + offline,
                       help="; ".join(f"{k}: {v}" for k, v in ALGORITHMS.items()) + "; " +
                       "; ".join(f"{k}: {PASSTHROUGH[('train', k)][1]}" for k in offline) + own_flags)
    train.add_argument("--config", help="YAML config file (see examples/)")
    train.add_argument("--nproc", type=int, metavar="N", help=NPROC_HELP)
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.lr=1e-5 rollout.n=8")

    demo = sub.add_parser("demo", help="GRPO on the embedded tiny model, with before/after held-out accuracy",
                          epilog="; ".join(f"alignrl demo {w[1]} [--help]: {PASSTHROUGH[w][1]}"
                                           for w in PASSTHROUGH if w[0] == "demo"))
    demo.add_argument("--nproc", type=int, metavar="N", help=NPROC_HELP)
    demo.add_argument("overrides", nargs="*", help="dotted overrides on top of the demo config")

    build = sub.add_parser("build-demo-model", help="(re)build the embedded tiny base model from its seed")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--out", help="write here instead of the cache folder")

    cfg = sub.add_parser("config", help="print the resolved config, or the reference of all keys")
    cfg.add_argument("--config", help="YAML config file")
    cfg.add_argument("--reference", action="store_true", help="print every key with default and meaning")
    cfg.add_argument("overrides", nargs="*")

    serve = sub.add_parser("serve", help="run a service: " + ", ".join(w[1] for w in PASSTHROUGH if w[0] == "serve"))
    serve.add_argument("service", choices=[w[1] for w in PASSTHROUGH if w[0] == "serve"])
    sub.add_parser("doctor", help=PASSTHROUGH[("doctor",)][1])
    sub.add_parser("sample", help=PASSTHROUGH[("sample",)][1])
    return p


def preflight(cfg: RunConfig, world: int, *, reward_fn: bool = False) -> None:
    """What can fail about a run without loading a model, checked before anything expensive: the batch
    split over `world` ranks and the data files (and, before a launch, the reward function's import)."""
    from alignrl.data.loaders import check_data_file, check_sources, data_files
    from alignrl.rewards.registry import REWARDS

    check_world_size(cfg, world)
    check_folders({"trainer.output_dir": cfg.run_dir, "trainer.checkpoint_dir": cfg.checkpoint_root,
                   "trainer.log_dir": cfg.log_root})
    for key in ("train_files", "val_files") if not cfg.data.dataset_class else ():  # a dataset class reads them
        for path in data_files(getattr(cfg.data, key)):
            check_data_file(path, f"data.{key}")
            if cfg.algorithm.reward_fn is None:  # a user's reward function decides what it scores
                check_sources(path, REWARDS, f"data.{key}")
    if reward_fn:
        from alignrl.rewards.registry import check_user_fns

        check_user_fns(cfg)
    if cfg.algorithm.reward_model or cfg.safety.cost_model:  # before the policy loads (rm imports torch: last)
        from alignrl.preference.rm import check_rl_scorers

        check_rl_scorers(cfg, tokenizers=True)
    from alignrl.rollout.service_health import check_services

    check_services(cfg)


def _port_given(args: argparse.Namespace, cfg: RunConfig | None) -> int | None:
    """trainer.master_port when the config file or the command line sets it: else `--nproc` takes MASTER_PORT or a
    free port, so that two runs on one machine do not meet at the default 29500."""
    if cfg is None or "trainer.master_port" not in keys_given(_config_path(args), args.overrides):
        return None
    return cfg.trainer.master_port


def _config_path(args: argparse.Namespace) -> Path | str | None:
    return EXAMPLES / "demo.yaml" if args.command == "demo" else args.config


def _parse(argv: list[str]) -> argparse.Namespace:
    """Overrides may come before or after options (`--config f.yaml a.b=1`); argparse's subparsers
    cannot intermix positionals with options, so they are collected from the leftovers too."""
    from alignrl.config.verl_hydra import hydra_selection  # verl scripts pick Hydra configs this way

    argv, from_config = hydra_selection(argv)
    args, rest = _parser().parse_known_args(argv)
    bad = [r for r in rest if r.startswith("-") or "=" not in r]
    if bad:
        raise ConfigError(f"unrecognized argument {bad[0]!r} (overrides look like key.sub=value; "
                          f"`alignrl {args.command} --help` lists the options)")
    if hasattr(args, "overrides"):  # a Hydra config's settings first: the command line's win, as in Hydra
        args.overrides = from_config + list(args.overrides) + rest
    elif rest or from_config:
        raise ConfigError(f"`alignrl {args.command}` takes no overrides (got {rest[0]!r})")
    return args


def _run(args: argparse.Namespace, cfg: RunConfig | None) -> int:
    """`cfg`: the loaded run config of `train` / `demo` (None for the other commands)."""
    if args.command == "config":
        from alignrl.config import reference_markdown, to_yaml

        print(reference_markdown() if args.reference else to_yaml(load_config(args.config, args.overrides)), end="\n")
        return 0
    if args.command == "build-demo-model":
        from alignrl.models.tiny import TinyRecipe, build_demo_model, cache_root

        recipe = TinyRecipe(seed=args.seed)
        build_demo_model(Path(args.out) if args.out else cache_root() / f"demo-{recipe.key()}", recipe)
        return 0
    start = time.time()
    assert cfg is not None
    # under raw torchrun every rank checks before joining the process group, so a bad split fails at once
    preflight(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    from alignrl.runner import train_grpo
    from alignrl.runtime.env import shutdown

    summary = train_grpo(cfg, wall_start=start)
    shutdown()  # leave the process group (NCCL warns of leaked resources otherwise)
    if summary is None:  # ranks other than 0 under torchrun
        return 0
    last_number = (f" (last-number: {summary['base_accuracy_flexible']:.3f} -> {summary['final_accuracy_flexible']:.3f}, "
                   f"{summary['gain_points_flexible']:+.1f} points)" if "gain_points_flexible" in summary else "")
    print(f"base_accuracy={summary['base_accuracy']:.3f} final_accuracy={summary['final_accuracy']:.3f} "
          f"gain={summary['gain_points']:+.1f} points{last_number} "
          f"steps={summary['steps']} wall_seconds={summary['wall_seconds']:.0f}")
    return 0


def _interrupted_line(argv: list[str], routed, cfg: RunConfig | None = None, how: str = "interrupted") -> str:
    """What Ctrl-C (or SIGTERM: `how`) leaves: with the run's config, whether the same command resumes, and from
    which checkpoint, or starts over."""
    if routed or argv[:1] not in (["train"], ["demo"]):
        return f"{program()}: {how}"
    if cfg is None:  # still starting
        return f"{program()}: {how} while starting; the same command starts it again (from the run's last " \
               "checkpoint, if it has one)"
    if cfg.trainer.resume_mode != "auto":
        return in_flag_words(f"{program()}: {how}; the same command starts over (trainer.resume_mode="
                             f"{cfg.trainer.resume_mode}; auto continues from the last checkpoint)")
    from alignrl.train.checkpoint import latest_checkpoint

    found, _ = latest_checkpoint(cfg.checkpoint_root)
    if found is None:
        every = (f"one every trainer.save_freq={cfg.trainer.save_freq} steps" if cfg.trainer.save_freq else
                 "trainer.save_freq=0 saves the final step only")
        return in_flag_words(f"{program()}: {how} before the first checkpoint ({every}): the same command starts over")
    return f"{program()}: {how}; the same command continues from {found}"


def _resume_note(e: Exception, cfg: RunConfig | None) -> str:
    """For a service that stopped answering mid-run (it comes back; the config was fine): where the same command
    continues from, once the service answers again."""
    from alignrl.rollout.remote import ServiceError

    if not (isinstance(e, ServiceError) and e.down) or cfg is None or cfg.trainer.resume_mode != "auto":
        return ""
    from alignrl.train.checkpoint import latest_checkpoint

    try:
        found, _ = latest_checkpoint(cfg.checkpoint_root)
    except OSError:  # the error line itself must still be one line
        return ""
    return "" if found is None else f"; once it answers, the same command continues from {found}"


def _leave_process_group() -> None:
    """Left to the interpreter's exit, gloo's threads could abort it ("terminate called without an active
    exception") after the run's one line."""
    if "torch.distributed" in sys.modules:
        from alignrl.runtime.env import shutdown

        shutdown()


def _stop_at_once_on_ctrl_c(line: str) -> None:
    """A rank stopped by Ctrl-C while it is still starting (imports, model load) exits at once, rank 0 saying why:
    a KeyboardInterrupt inside an import leaves half-loaded extension modules that fail again with other errors.
    init_distributed's own handlers take over once the process group is up."""
    def stop(signum, frame):
        if os.environ.get("RANK", "0") == "0":
            print(line, file=sys.stderr, flush=True)
        os._exit(130)

    signal.signal(signal.SIGINT, stop)


def _was_interrupted() -> bool:
    env = sys.modules.get("alignrl.runtime.env")
    return env is not None and env.interrupted()


def _interrupted_exit(argv: list[str], routed, cfg: RunConfig | None, term: bool) -> int:
    """Ctrl-C (or SIGTERM) stopped the run: rank 0 says so in one line, with where the same command resumes."""
    if os.environ.get("RANK", "0") == "0":
        print(_interrupted_line(argv, routed, cfg, "stopped by SIGTERM" if term else "interrupted"),
              file=sys.stderr, flush=True)
    _leave_process_group()
    return 143 if term else 130


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # this process's entry point (the console script, `python -m alignrl`, a torchrun rank)
        starting()
    argv = sys.argv[1:] if argv is None else list(argv)
    routed = _passthrough(argv)
    if "LOCAL_RANK" in os.environ and not routed:
        _stop_at_once_on_ctrl_c(_interrupted_line(argv, routed))
    cfg, old_term = None, None
    try:
        if routed:  # these check their own input and handle `--nproc` themselves
            import importlib

            (module, _, function), rest = routed[0].partition(":"), routed[1]
            return getattr(importlib.import_module(module), function or "main")(rest)
        from alignrl.runtime.launch import pop_nproc, torchrun

        argv = _in_alignrl_words(argv)
        try:
            nproc, argv = pop_nproc(argv)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        args = _parse(argv)
        old_term = stop_on_sigterm()  # `kill` of a run says what it leaves, as Ctrl-C does
        # loaded once: with verl's total_epochs it counts the data files' rows
        cfg = load_config(_config_path(args), args.overrides) if args.command in ("train", "demo") else None
        if not nproc and args.command == "train" and "LOCAL_RANK" not in os.environ and os.environ.get("RAY_ADDRESS"):
            # inside a Ray job: trainer.nnodes × n_gpus_per_node ranks placed on the cluster (verl's layout)
            from alignrl.placements.ray.verl_job import run_on_ray

            return run_on_ray(cfg, f"alignrl train {args.algorithm}",
                              lambda: preflight(cfg, cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node, reward_fn=True))
        if not nproc and args.command == "train" and "LOCAL_RANK" not in os.environ:
            # verl's trainer.nnodes × n_gpus_per_node as local torchrun ranks
            from alignrl.config.counts import requested_world_size

            nproc = requested_world_size(cfg)
        if nproc and nproc > 1 and "LOCAL_RANK" not in os.environ:
            if cfg is not None:  # a bad config fails here, once, not on every rank
                preflight(cfg, nproc, reward_fn=True)
            return torchrun(nproc, ["alignrl", *argv], master_port=_port_given(args, cfg), preload=RANK_IMPORTS)
        return _run(args, cfg)
    except Exception as e:
        from alignrl.runtime.launch import peer_lost

        if peer_lost(e) and _was_interrupted():  # this rank's KeyboardInterrupt was lost; its peers stopped on theirs
            return _interrupted_exit(argv, routed, cfg, term=False)
        if peer_lost(e):  # torchrun's agent names the rank that died
            print(f"{program()}: rank {os.environ.get('RANK', '?')}: lost its connection to another rank, which "
                  "stopped or was killed", file=sys.stderr, flush=True)
            return 1
        if not isinstance(e, UserError):
            raise
        from alignrl.runtime.one_line import speak_once

        if getattr(e, "this_rank_only", False):  # the other ranks met no error: torchrun's agent stops them
            print(f"{program()}: error: {in_flag_words(str(e))}", file=sys.stderr, flush=True)
            code = 2
        else:
            code = speak_once(f"{program()}: error: {in_flag_words(str(e))}{_resume_note(e, cfg)}")
        _leave_process_group()
        return code
    except KeyboardInterrupt as e:  # a terminal's Ctrl-C reaches every rank of the launch: rank 0 speaks
        return _interrupted_exit(argv, routed, cfg, term=isinstance(e, Terminated))
    finally:  # a caller in this process (a notebook, a test) keeps its own SIGTERM handling
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        if "alignrl.runtime.env" in sys.modules:  # a torchrun rank's exit is not stopped by its agent's SIGTERM
            sys.modules["alignrl.runtime.env"].finished()


if __name__ == "__main__":
    sys.exit(main())
