"""communication_test.py: two processes, as the ZeroMQ pipeline runs. This one binds --data-port and --sync-port as
the trainer does and starts `python -m alignrl.compat.zmq_comm_test` (comm_peer_main), which connects as the sampler does; a scored
batch (with reference log-probs) and the weights make the round trip between them."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from alignrl.runtime.one_line import OneLineParser
from alignrl.compat.zmq_pipeline import ports_problem

COMM = "communication_test"
PEER_START_S = 600.0  # for the sampler process to import torch, load the model and make its batch


def comm_parser(prog: str = "communication_test.py") -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description="Round trip of the pipeline's messages (a scored batch with reference "
                      "log-probs, the weights) between two processes over the two ports: prints one sample, latency "
                      "and throughput; exits 1 if a port is taken, nothing answers, or anything arrives different.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (this process) and connect to (the other)")
    p.add_argument("--data-port", type=int, default=5555, help="port of the scored batches (sampler -> trainer)")
    p.add_argument("--sync-port", type=int, default=5556, help="port of the weights (trainer -> sampler)")
    p.add_argument("--model-path", default="demo", help="HF model folder (default: the embedded demo model)")
    p.add_argument("--rounds", type=int, default=20, help="timed round trips of each message")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for each answer")
    return p


def comm_args_problem(a: argparse.Namespace) -> str | None:
    if a.rounds < 1:
        return f"--rounds {a.rounds}: give the number of timed round trips, 1 or more (default 20)"
    if not a.timeout > 0:
        return f"--timeout {a.timeout:g}: give the seconds to wait for each answer, above 0 (default 30)"
    problem = ports_problem(a.host, a.data_port, a.sync_port)
    if problem:
        return problem
    if a.model_path != "demo" and not (Path(a.model_path) / "config.json").is_file():
        return (f"--model-path {a.model_path}: not a Hugging Face model folder (no config.json there); give a folder "
                "saved with save_pretrained, or leave it out for the embedded demo model")
    return None


def _connect_host(host: str) -> str:
    return {"0.0.0.0": "127.0.0.1", "*": "127.0.0.1", "::": "::1"}.get(host, host)


def _digest(tensors: dict) -> str:
    """sha256 over the names, dtypes, shapes and bytes of a message's tensors."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{list(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _load(path: str):
    from alignrl.models.loader import load_model

    return load_model(path, log=lambda *_: None)


def _failed(why: str) -> int:
    print(f"{COMM}: FAILED: {why}", file=sys.stderr)
    return 1


def comm_test_main(argv: list[str] | None = None) -> int:
    """communication_test.py: the trainer's side of the test; the sampler's side is a second process."""
    p = comm_parser()
    a = p.parse_args(argv)
    problem = comm_args_problem(a)
    if problem:
        p.error(problem)
    import secrets

    from alignrl.wire.weight_buckets import encode_weights
    from alignrl.runtime.ports import is_loopback
    from alignrl.wire.zmq_link import token_from_env
    from alignrl.models.loader import ModelError

    # beyond loopback the sockets want a shared token: the two processes of this test make one up between them
    token = token_from_env() or ("" if is_loopback(a.host) else secrets.token_hex(16))
    socks = []
    try:
        why = _bind(a, token, socks)
        if why is not None:
            return _failed(why)
        pull, rep = socks
        try:
            model, tok = _load(a.model_path)
        except (ModelError, OSError, ValueError) as e:
            print(f"communication_test.py: error: --model-path {a.model_path}: {e}", file=sys.stderr)
            return 2
        weights = encode_weights(model.named_parameters(), 1, token=token)
        nbytes = sum(len(memoryview(f)) for f in weights)
        report, why = _run_peer(a, pull, rep, weights, tok, token)
    finally:
        for s in socks:
            s.close()
    if why is not None:
        return _failed(why)
    print(f"two processes: pid {os.getpid()} (trainer side) bound {pull.addr} (--data-port) and {rep.addr} "
          f"(--sync-port); pid {report['pid']} (sampler side) connected to both")
    batch_ms, weights_s = float(report["batch_ms"]), max(float(report["weights_ms"]) / 1e3, 1e-9)
    print(f"scored batch ({report['samples']} samples): {batch_ms:.2f} ms per round trip; weights "
          f"({nbytes / 2**20:.1f} MiB): {weights_s * 1e3:.1f} ms, {nbytes / 2**20 / weights_s:.0f} MiB/s")
    if not report.get("ok"):
        return _failed(str(report.get("problem")))
    print(f"{COMM}: OK")
    return 0


def _bind(a, token: str, socks: list) -> str | None:
    """Binds --data-port (a Puller) and --sync-port (a Replier) into `socks`, which the caller closes; why not, or
    None."""
    from alignrl.wire.zmq_link import InsecureBind, PortInUse, Puller, Replier

    for cls, port, flag, what in ((Puller, a.data_port, "--data-port", "data"),
                                  (Replier, a.sync_port, "--sync-port", "sync")):
        try:
            socks.append(cls(a.host, port, token=token, port_flag=flag))
        except PortInUse:
            return (f"port {port} on {a.host} ({flag}) is taken by another program: stop it, or give this "
                    f"test and both workers other ports ({flag} N)")
        except OSError as e:
            return f"cannot bind {flag} {port} on {a.host}: {e.strerror or e}"
        except InsecureBind as e:
            return str(e)
    return None


def _run_peer(a, pull, rep, weights, tok, token: str) -> tuple[dict | None, str | None]:
    """Starts the sampler's side and answers it until its report: (report, None), or (None, why)."""
    import tempfile

    import alignrl
    from alignrl.wire.records import KIND, from_wire, seed_rows
    from alignrl.wire.frames import TOKEN_ENV, WireError

    root = str(Path(alignrl.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
           TOKEN_ENV: token}
    with tempfile.TemporaryFile("w+") as err:
        peer = subprocess.Popen([sys.executable, "-m", "alignrl.compat.zmq_comm_test",
                                 "--host", _connect_host(a.host), "--data-port", str(pull.port),
                                 "--sync-port", str(rep.port), "--model-path", a.model_path,
                                 "--rounds", str(a.rounds), "--timeout", f"{a.timeout:g}"],
                                env=env, stdout=subprocess.DEVNULL, stderr=err)
        try:
            report, why = _serve(a, pull, rep, peer, weights, tok, KIND, from_wire, seed_rows, WireError)
            if why is None:
                try:
                    peer.wait(timeout=a.timeout)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            if peer.poll() is None:
                peer.kill()
            peer.wait()
        if why is None and report is None:  # the process exited first: its last line on stderr says why
            err.seek(0)
            lines = [x for x in err.read().splitlines() if x.strip()]
            why = (f"the sampler process (pid {peer.pid}) stopped: {lines[-1].strip() if lines else 'no message'}"
                   f" (exit {peer.returncode})")
    return report, why


def _serve(a, pull, rep, peer, weights, tok, kind, from_wire, seed_rows, WireError) -> tuple[dict | None, str | None]:
    """Answers the sampler process until its report: (report, None), or (None, why) on a failure here, or
    (None, None) when the process exited first (its own line says why)."""
    import time

    shown, hello = False, False
    last = time.monotonic()
    while True:
        try:
            got = rep.recv(0.2)
        except WireError as e:
            return None, f"a malformed request arrived on --sync-port {rep.port}: {e}"
        if got is None:
            if peer.poll() is not None:
                return None, None
            if time.monotonic() - last > (a.timeout if hello else PEER_START_S):
                return None, (f"the sampler process (pid {peer.pid}) sent nothing to --sync-port {rep.port} for "
                              f"{a.timeout if hello else PEER_START_S:g} s")
            continue
        last = time.monotonic()
        who, msg = got
        if msg.kind == "hello":
            hello = True
            rep.reply_msg(who, "welcome", {"pid": os.getpid()})
        elif msg.kind == "echo":
            try:
                batch = pull.recv(a.timeout)
            except WireError as e:
                return None, f"a malformed message arrived on --data-port {pull.port}: {e}"
            if batch is None:
                return None, (f"the scored batch the sampler process pushed did not arrive on --data-port "
                              f"{pull.port} within {a.timeout:g} s")
            if not shown:
                try:
                    from_wire(batch)  # what the trainer checks and builds
                except WireError as e:
                    return None, f"the scored batch is not one the trainer takes: {e}"
                if batch.meta.get("sha256") != _digest(batch.tensors):
                    return None, "the scored batch arrived different from what the sampler process sent"
                print("one sample as the trainer sees it (the ZeroMQ pipeline's fields):")
                for k, v in seed_rows(batch, tok)[0].items():
                    shown_v = v if not hasattr(v, "shape") else f"numpy.ndarray {v.dtype} {list(v.shape)}"
                    print(f"  {k}: {shown_v if len(str(shown_v)) < 100 else str(shown_v)[:97] + '...'}")
                sys.stdout.flush()
                shown = True
            rep.reply_msg(who, kind, batch.meta, batch.tensors)  # back, for the sampler to compare
        elif msg.kind == "send_weights":
            rep.reply(who, weights)
        elif msg.kind == "report":
            rep.reply_msg(who, "bye", {})
            return dict(msg.meta), None
        else:
            return None, f"the sampler process asked {msg.kind!r}, which this test does not know"


def comm_peer_main(argv: list[str] | None = None) -> int:
    """The sampler's side of communication_test.py (started by it): makes a scored batch with the producer on the
    model (with reference log-probs), pushes it to --data-port and asks for it back on --sync-port, then asks for
    the weights; compares both with its own; reports. Any failure is one line on stderr, exit 1."""
    a = comm_parser("communication_test.py (sampler side)").parse_args(argv)
    import time

    import torch

    from alignrl.placements.build import build_maker, build_ref
    from alignrl.data.prompts import PromptData
    from alignrl.config import load_config
    from alignrl.data import synthetic
    from alignrl.runtime.env import SINGLE
    from alignrl.wire.records import KIND, to_wire
    from alignrl.wire.frames import WireError
    from alignrl.wire.zmq_link import PeerTimeout, Pusher, Requester, address, token_from_env
    from alignrl.rollout.hf_engine import HFRolloutEngine

    try:
        cfg = load_config(None, [f"model.path={a.model_path}", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
                                 "rollout.n=4", "rollout.max_new_tokens=24"])
        model, tok = _load(a.model_path)
        ref = build_ref(cfg, torch.device("cpu"), base=model)  # the sampler computes them, as in the pipeline
        maker = build_maker(cfg, HFRolloutEngine(model, tok), tok, ref, SINGLE.device, SINGLE.rank)
        batch = maker.make(1, [0, 1], PromptData(tok, synthetic.generate("train", 2, seed=0), 128))
        meta, tensors = to_wire(batch, tok, lease="test:1")
        meta["sha256"] = _digest(tensors)
        token = token_from_env()
        with Pusher(address(a.host, a.data_port), hwm=4, token=token) as push, \
                Requester(address(a.host, a.sync_port), token=token) as req:
            try:
                req.request("hello", {"pid": os.getpid()}, timeout_s=a.timeout)
            except PeerTimeout:
                raise PeerTimeout(f"nothing answers on {req.addr} (--sync-port) within {a.timeout:g} s: check "
                                  "--host and the ports, and that no firewall sits between the processes") from None
            problem, times = None, []
            for i in range(a.rounds + 1):  # round 0 is checked, the others timed
                t0 = time.perf_counter()
                push.send(KIND, meta, tensors, timeout_s=a.timeout)
                back = req.request("echo", {"round": i}, timeout_s=a.timeout)
                times.append(time.perf_counter() - t0)
                same = back.kind == KIND and back.meta == meta and set(back.tensors) == set(tensors) and all(
                    back.tensors[k].dtype == t.dtype and torch.equal(back.tensors[k], t) for k, t in tensors.items())
                if i == 0 and not same:
                    problem = "the scored batch came back different from what was sent"
            batch_ms = sum(times[1:]) / a.rounds * 1e3
            times, mine = [], dict(model.named_parameters())
            for i in range(a.rounds + 1):
                t0 = time.perf_counter()
                w = req.request("send_weights", {}, timeout_s=a.timeout)
                times.append(time.perf_counter() - t0)
                if i == 0 and not (set(w.tensors) == set(mine) and all(
                        torch.equal(w.tensors[n], t.detach()) for n, t in mine.items())):
                    problem = problem or "the weights arrived different from the model's"
            weights_ms = sum(times[1:]) / a.rounds * 1e3
            req.request("report", {"pid": os.getpid(), "ok": problem is None, "problem": problem,
                                   "batch_ms": batch_ms, "weights_ms": weights_ms, "samples": len(batch)},
                        timeout_s=a.timeout)
        return 0 if problem is None else 1
    except (PeerTimeout, WireError) as e:
        print(str(e), file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - one line for the test's report, whatever it was
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # communication_test.py's other process: the sampler's side
    sys.exit(comm_peer_main(sys.argv[1:]))
