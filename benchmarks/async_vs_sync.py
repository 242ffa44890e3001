"""GRPO samples/s in-process vs the ZeroMQ pipeline (on-policy k=0, asynchronous k=1, each with and without
lent cores, k=1 with two samplers), the held-out accuracy each way reaches after the same steps, and the
weight-publish cost against a raw ZeroMQ copy of the same bytes. One command.

    python benchmarks/async_vs_sync.py                      # demo model, 12 steps, 8 prompts x 8, <= 48 tokens
    python benchmarks/async_vs_sync.py --quick              # 4 steps, 4 prompts x 4, <= 16 tokens: a smoke run
    python benchmarks/async_vs_sync.py --model path/to/hf_folder --steps 20 --prompts 16

Workload: every configuration trains the same model (`--model`) for `--steps` RL steps of `--prompts`
prompts x `--n` samples (`--max-new-tokens` at most), same seed, data, learning rate and loss, intermediate
evaluation and checkpoints off, `actor.share_prompt` and `actor.use_remove_padding` as in the demo recipe
(`--no-share-prompt`, `--no-remove-padding`). Each configuration is a fresh trainer process (plus samplers),
all of them again in each of `--rounds` rounds (default 3; this machine's speed drifts by a quarter between
minutes): the table reports each one's median round, beside every round's samples/s and paired ratios:

    in-process            `alignrl train grpo`, trainer.threads=2 (generation and training share 2 cores)
    zmq k=0               trainer (1 thread) + 1 sampler (1 thread), pipeline.max_staleness=0 (on-policy)
    zmq k=1               trainer (1 thread) + 1 sampler (1 thread), pipeline.max_staleness=1
    zmq k=0/1 own cores   the same with pipeline.lend_cores=false: each process keeps its one thread (the other
                          zmq rows lend the cores of the side that waits to the side that works, the default)
    zmq k=1 frames        the same with pipeline.weight_transport=zmq (frames on the sync port; the other rows
                          use auto: memory both processes map, shared memory on the CPU, CUDA IPC on a GPU)
    zmq k=1 x2 samplers   trainer (1 thread) + 2 samplers (1 thread each): 3 threads on 2 cores

What is measured: samples/s = sequences trained (prompts x n per step) / seconds, over steps 2..S: the sum
of the trainer's own `timing/step` rows in metrics.jsonl ("get the next scored batch, then update and
publish"; only per-step logging falls between two steps). Step 1 (warm-up), start-up, model loading,
sampler connection and the evaluations are left out; the trainer process's wall time is printed too. The
bound under the table is the two-stage pipeline's, from the k=1 run's own timings: no step can take less than
the slower stage, the trainer's update and publish (its step less its wait) or the sampler's generation,
reference log-probs and reward of one batch. (Twice the one-thread in-process rate is no bound: each pipeline
process runs one kind of work, and the waiting side lends its core.) Under it, the machine's bound for any
placement of those two stages, per round: the one-thread run's (`own cores`) trainer and sampler work added up
is the core-seconds a step needs at best (a second thread never does more than the first), and the cores give
no more than their count of core-seconds a second; in-process s/step over that is the most any overlap can
reach here. Also printed per configuration:
mean generation s per batch (`timing/gen`, where generation ran), update s (`timing/train`), the trainer's
wait for a batch, staleness, and publish time. Timings only mean something on an otherwise idle machine.

Accuracy: held-out greedy accuracy (summary.json, `--val` problems) of the in-process and k=1 runs after S steps.

Weight publish (`publish_bench.py`), for two weight sets (the demo model's 3 MiB, and `--publish-mib`
MiB of synthetic fp32 tensors shaped like a transformer's): `--publish-repeats` times,
`WeightsEncoder` (the trainer's snapshot) + its frames over ZeroMQ PUSH/PULL on 127.0.0.1 + `wire.decode`
(tensors by name), against a raw ZeroMQ copy of the same bytes (one blob sent with copy=True); the blob
sent zero-copy (no snapshot: a lower bound), encode and decode alone, and the same-host shared path are
printed too (medians; details in publish_bench.py).

Targets (printed with PASS/MISS): zmq k=1 >= 1.9x in-process samples/s; publish <= 1.5x the raw ZeroMQ
copy, for the worse of the two weight sets, as frames (samplers elsewhere) and through shared memory (samplers
on the trainer's host, pipeline.weight_transport=auto; the weights here are on the CPU, so not CUDA IPC).
Every child process is started in its own session and killed (killpg) at the end; ports are free ones on
127.0.0.1; outputs go to a temporary folder (removed at the end unless --keep). Not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline_bounds import mean_of, print_core_bound, print_k1_bound
from publish_bench import demo_weights, print_publish, publish_bench, synthetic_weights

SRC = str(Path(__file__).resolve().parents[1] / "src")
K1_TARGET, PUBLISH_TARGET = 1.9, 1.5


@dataclass
class Case:
    name: str
    placement: str  # inline | zmq
    staleness: int = 0
    samplers: int = 0
    threads: int = 2  # in-process only: torch threads of the one process
    lend: bool = True  # zmq only: pipeline.lend_cores
    transport: str = "auto"  # zmq only: pipeline.weight_transport


CASES = [Case("in-process", "inline"), Case("zmq k=0", "zmq", 0, 1),
         Case("zmq k=0 own cores", "zmq", 0, 1, lend=False), Case("zmq k=1", "zmq", 1, 1),
         Case("zmq k=1 own cores", "zmq", 1, 1, lend=False), Case("zmq k=1 frames", "zmq", 1, 1, transport="zmq"),
         Case("zmq k=1 x2 samplers", "zmq", 1, 2)]


@dataclass
class Result:
    case: Case
    ok: bool = False
    error: str = ""
    rows: list = field(default_factory=list)  # metrics rows of steps >= 1
    summary: dict = field(default_factory=dict)
    proc_wall: float = 0.0
    samples_per_s: float = 0.0


def spawn(argv: list[str], threads: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
        return subprocess.Popen([sys.executable, "-m", "alignrl", *argv], stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)


def kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def tail(path: Path, n: int = 2500) -> str:
    return path.read_text(errors="replace")[-n:] if path.is_file() else "(no output)"


def overrides(args, model_dir: Path, out: Path, name: str) -> list[str]:
    p, n = args.prompts, args.n
    return [f"model.path={model_dir}", "data.train_size=2048", f"data.val_size={args.val}",
            f"data.val_size_during_training={min(args.val, 8)}", f"data.train_batch_size={p}",
            f"rollout.n={n}", f"rollout.max_new_tokens={args.max_new_tokens}",
            f"actor.ppo_mini_batch_size={args.mini_batch}", f"actor.ppo_micro_batch_size={args.micro_batch}",
            f"actor.lr={args.lr}", "actor.kl_loss_coef=0.001", "actor.kl_loss_type=low_var_kl",
            "actor.recompute_old_logprobs=false", f"actor.share_prompt={str(args.share_prompt).lower()}",
            f"actor.use_remove_padding={str(args.remove_padding).lower()}",
            f"trainer.total_training_steps={args.steps}",
            "trainer.test_freq=0", "trainer.save_freq=0", "trainer.max_checkpoints=1", "trainer.resume_mode=disable",
            "trainer.seed=0", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
            f"trainer.output_dir={out}", f"trainer.experiment_name={name}"]


def run_case(case: Case, args, model_dir: Path, root: Path, round_no: int = 1) -> Result:
    res = Result(case)
    slug = case.name.replace(" ", "_").replace("=", "").replace("x2_", "x2") + f"_r{round_no}"
    out = root / "runs"
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ovr = overrides(args, model_dir, out, slug)
    procs: list[subprocess.Popen] = []
    names: list[str] = []
    t0 = time.perf_counter()
    try:
        if case.placement == "inline":
            procs.append(spawn(["train", "grpo", *ovr, f"trainer.threads={case.threads}"], case.threads,
                               logs / f"{slug}.trainer"))
            names.append("trainer")
        else:
            from alignrl.runtime.ports import free_ports

            data_port, sync_port = free_ports(2)
            procs.append(spawn(["train", "grpo", *ovr, "trainer.threads=1", "pipeline.placement=zmq",
                                "pipeline.host=127.0.0.1", f"pipeline.data_port={data_port}",
                                f"pipeline.sync_port={sync_port}", f"pipeline.max_staleness={case.staleness}",
                                f"pipeline.lend_cores={str(case.lend).lower()}", f"pipeline.weight_transport={case.transport}",
                                f"pipeline.peer_timeout_s={args.timeout}"], 1, logs / f"{slug}.trainer"))
            names.append("trainer")
            for i in range(case.samplers):
                procs.append(spawn(["sample", "--model-path", str(model_dir), "--host", "127.0.0.1",
                                    "--data-port", str(data_port), "--sync-port", str(sync_port), "--threads", "1",
                                    "--sampler-id", f"s{i}", "--peer-timeout", str(args.timeout)], 1,
                                   logs / f"{slug}.sampler{i}"))
                names.append(f"sampler{i}")
        trainer = procs[0]
        deadline = time.monotonic() + args.timeout
        while trainer.poll() is None:
            dead = [(nm, p) for nm, p in zip(names[1:], procs[1:]) if p.poll() not in (None, 0)]
            if dead or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        res.proc_wall = time.perf_counter() - t0
        if trainer.poll() != 0:
            dead = [f"{nm} exited {p.returncode}" for nm, p in zip(names[1:], procs[1:]) if p.poll() not in (None, 0)]
            why = ("; ".join(dead) + " before the trainer finished" if trainer.returncode is None and dead else
                   f"trainer still running after {args.timeout:.0f}s" if trainer.returncode is None else
                   "; ".join([f"trainer exited {trainer.returncode}", *dead]))
            res.error = why + "\n" + "\n".join(
                f"--- {nm} stderr (tail) ---\n{tail(logs / f'{slug}.{nm}.err')}" for nm in names)
            return res
        for p in procs[1:]:  # samplers are told the run is over; give them a moment, then they are killed
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
    finally:
        kill(procs)
    run_dir = out / slug
    rows = [json.loads(x) for x in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    res.rows = sorted((r for r in rows if r.get("step", 0) >= 1), key=lambda r: r["step"])
    res.summary = json.loads((run_dir / "summary.json").read_text())
    timed = [r for r in res.rows if r["step"] >= 2]
    if len(res.rows) != args.steps or not timed:
        res.error = f"expected {args.steps} step rows in metrics.jsonl, found {len(res.rows)}"
        return res
    res.samples_per_s = args.prompts * args.n * len(timed) / sum(r["timing/step"] for r in timed)
    res.ok = True
    return res


def median_run(rs: list[Result]) -> Result:
    """The round with the median samples/s (the lower middle one of an even count), or a failed one if any
    round failed: a failure is never hidden behind the others."""
    failed = [r for r in rs if not r.ok]
    if failed:
        return failed[0]
    return sorted(rs, key=lambda r: r.samples_per_s)[(len(rs) - 1) // 2]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="RL steps per configuration (step 1 is warm-up)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (data.train_batch_size)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (rollout.n)")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="response length limit")
    ap.add_argument("--model", default="demo", help="HF model folder, or 'demo' (the embedded tiny model)")
    ap.add_argument("--mini-batch", type=int, default=None,
                    help="prompts per optimizer step (actor.ppo_mini_batch_size; default --prompts: one update)")
    ap.add_argument("--micro-batch", type=int, default=32, help="sequences per forward/backward")
    ap.add_argument("--share-prompt", action=argparse.BooleanOptionalAction, default=True,
                    help="actor.share_prompt, as in the demo recipe: each distinct prompt of a micro-batch runs once")
    ap.add_argument("--remove-padding", action=argparse.BooleanOptionalAction, default=True,
                    help="actor.use_remove_padding, as in the demo recipe: packed, padding-free forwards")
    ap.add_argument("--lr", type=float, default=4e-5, help="actor.lr (constant; the demo recipe's peak)")
    ap.add_argument("--val", type=int, default=64, help="held-out problems of the base and final evaluation")
    ap.add_argument("--publish-repeats", type=int, default=60, help="rounds per variant (medians)")
    ap.add_argument("--publish-mib", type=int, default=256, help="size of the synthetic weight set (0: skip it)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a configuration may take")
    ap.add_argument("--rounds", type=int, default=3,
                    help="runs of every configuration, interleaved; each one's median round is reported")
    ap.add_argument("--only", action="append", choices=[c.name for c in CASES], help="run only these (repeatable)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (runs and child logs)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 steps, 4 prompts x 4, <= 16 tokens")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.prompts, args.n, args.max_new_tokens, args.rounds = 4, 4, 4, 16, 1
        args.val, args.publish_repeats = min(args.val, 16), min(args.publish_repeats, 5)
    args.mini_batch = args.mini_batch or args.prompts
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.steps < 2:
        ap.error("--steps must be at least 2 (step 1 is warm-up)")
    if args.prompts % args.mini_batch:
        ap.error("--mini-batch must divide --prompts")
    return args


def run_rounds(args, model_dir: Path, root: Path) -> dict[str, list[Result]]:
    """Every configuration once a round; rounds interleave the configurations, so drift hits them all."""
    runs: dict[str, list[Result]] = {}
    for round_no in range(1, args.rounds + 1):
        for case in CASES:
            if args.only and case.name not in args.only:
                continue
            print(f"running {case.name} (round {round_no}/{args.rounds}) ...", flush=True)
            runs.setdefault(case.name, []).append(run_case(case, args, model_dir, root, round_no))
    return runs


def run_publish(args, model_dir: Path) -> list[tuple[str, dict]]:
    pubs = []
    for label, weights in (("demo model" if args.model == "demo" else f"model {model_dir.name}",
                            lambda: demo_weights(model_dir)),
                           (f"{args.publish_mib} MiB synthetic", lambda: synthetic_weights(args.publish_mib))):
        if label.startswith("0 MiB"):
            continue
        try:
            pubs.append((label, publish_bench(weights(), args.publish_repeats)))
        except Exception as e:  # the tables above still get printed
            pubs.append((label, {"error": f"{type(e).__name__}: {e}"}))
    return pubs


def print_rounds(runs: dict[str, list[Result]]) -> None:
    print("samples/s of each round (the table below shows each configuration's median round):")
    for name, rs in runs.items():
        print(f"  {name:<21} " + "  ".join(f"{r.samples_per_s:7.2f}" if r.ok else "FAILED" for r in rs))
    for name, other in (("zmq k=1", "in-process"), ("zmq k=1", "zmq k=1 own cores"),
                        ("zmq k=0", "zmq k=0 own cores")):
        if name in runs and other in runs:
            paired = [f"{r.samples_per_s / b.samples_per_s:.2f}x" if r.ok and b.ok else "-"
                      for r, b in zip(runs[name], runs[other])]
            print(f"  {name} / {other} of the same round: {'  '.join(paired)}")
    print()


def fmt(v, spec, dash="-"):
    return dash if v is None else format(v, spec)


def print_table(results: list[Result], base: Result | None) -> None:
    head = (f"{'config':<21} {'samples/s':>9} {'vs in-proc':>10} {'s/step':>7} {'gen s':>6} {'train s':>7} "
            f"{'wait s':>7} {'stale':>5} {'publish ms':>10} {'proc wall s':>11}")
    print(head)
    print("-" * len(head))
    for r in results:
        if not r.ok:
            print(f"{r.case.name:<21} FAILED: {r.error.splitlines()[0] if r.error else '?'}")
            continue
        timed = [x for x in r.rows if x["step"] >= 2]
        ratio = f"{r.samples_per_s / base.samples_per_s:.2f}x" if base else "-"
        pub_ms = mean_of(timed, "pipeline/publish_s")
        print(f"{r.case.name:<21} {r.samples_per_s:>9.2f} {ratio:>10} "
              f"{statistics.mean(x['timing/step'] for x in timed):>7.3f} "
              f"{fmt(mean_of(timed, 'timing/gen'), '6.3f'):>6} {fmt(mean_of(timed, 'timing/train'), '7.3f'):>7} "
              f"{fmt(mean_of(timed, 'pipeline/trainer_wait_s'), '7.3f'):>7} "
              f"{fmt(mean_of(timed, 'pipeline/staleness'), '5.2f'):>5} "
              f"{fmt(None if pub_ms is None else 1000 * pub_ms, '10.1f'):>10} {r.proc_wall:>11.1f}")
    print("(s/step, gen s, train s, wait s, stale, publish ms: means over steps 2..S; gen s is measured where "
          "generation ran, train s is the trainer's update, wait s its wait for a batch)")


def print_accuracy(steps: int, val: int, base: Result | None, k1: Result | None) -> None:
    print()
    print(f"held-out greedy accuracy after {steps} steps ({val} problems):")
    print(f"  {'config':<12} {'base':>6} {'final':>6}")
    for name, r in (("in-process", base), ("zmq k=1", k1)):
        if r is None:
            print(f"  {name:<12} {'-':>6} {'-':>6}  (run failed or not run)")
        else:
            print(f"  {name:<12} {r.summary['base_accuracy']:>6.3f} {r.summary['final_accuracy']:>6.3f}")


def print_targets(base: Result | None, k1: Result | None, ratio_pub: float | None, shared: list[float]) -> None:
    print()
    r = f"{k1.samples_per_s / base.samples_per_s:.2f}x" if base and k1 else "not measured (a run failed)"
    print(f"target: zmq k=1 >= {K1_TARGET:.1f}x in-process samples/s: {r}"
          + (f" {'PASS' if k1.samples_per_s / base.samples_per_s >= K1_TARGET else 'MISS'}" if base and k1 else ""))
    if ratio_pub is None:
        print(f"target: publish <= {PUBLISH_TARGET:.1f}x raw copy: not measured (it failed)")
        return
    for how, r in (("frames, for samplers on other hosts", ratio_pub),
                   ("shared memory, for samplers on the trainer's host", max(shared))):
        print(f"target: publish <= {PUBLISH_TARGET:.1f}x raw copy (worst size), {how}: {r:.2f}x "
              f"{'PASS' if r <= PUBLISH_TARGET else 'MISS'}")


def main() -> int:
    args = parse_args()
    sys.path.insert(0, SRC)
    from alignrl.models.tiny import ensure_demo_model
    from alignrl.runtime.cores import usable_cores

    cores = usable_cores()  # affinity and a cgroup quota: the cores the bound below may count on
    model_dir = ensure_demo_model() if args.model == "demo" else Path(args.model).resolve()
    print(f"model {model_dir}")
    print(f"workload: {args.steps} steps x {args.prompts} prompts x {args.n} samples = "
          f"{args.prompts * args.n} sequences/step, <= {args.max_new_tokens} new tokens, "
          f"{args.prompts // args.mini_batch} optimizer step(s)/RL step, lr {args.lr:g}, "
          f"share_prompt {str(args.share_prompt).lower()}, remove_padding {str(args.remove_padding).lower()}, "
          f"held-out {args.val}; {cores} usable CPU core(s)")
    print("samples/s = sequences trained / sum of the trainer's timing/step over steps 2..S (step 1 = warm-up)")
    root = Path(tempfile.mkdtemp(prefix="alignrl-async-bench-"))
    try:
        runs = run_rounds(args, model_dir, root)
        pubs = run_publish(args, model_dir)
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)

    results = [median_run(rs) for rs in runs.values()]
    base = next((r for r in results if r.case.name == "in-process" and r.ok), None)
    k1 = next((r for r in results if r.case.name == "zmq k=1" and r.ok), None)
    print()
    if args.rounds > 1:
        print_rounds(runs)
    print_table(results, base)
    if base and k1:
        print_k1_bound(k1, base)
    if "in-process" in runs and "zmq k=1 own cores" in runs:
        print_core_bound(runs["zmq k=1 own cores"], runs["in-process"], cores, K1_TARGET)
    print_accuracy(args.steps, args.val, base, k1)
    print()
    ratio_pub, shared = print_publish(pubs, args.publish_repeats)
    print_targets(base, k1, ratio_pub, shared)
    failed = [r for r in results if not r.ok]
    for r in failed:
        print(f"\n=== {r.case.name} failed ===\n{r.error}")
    return 1 if failed or ratio_pub is None else 0

if __name__ == "__main__":
    sys.exit(main())
