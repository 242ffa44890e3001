"""Generation-service throughput (8 concurrent clients vs 1) and weight-sync time vs a raw loopback copy.

    python benchmarks/serve_bench.py [--model demo|PATH] [--requests 32] [--clients 8] [--skip-100m]

1. Throughput: the same `--requests` requests (one prompt, n samples, sampled, no seed) sent by one
   client one after another, then by `--clients` threads at once; the server batches concurrent
   requests into shared engine calls. Prints sequences/s and tokens/s of each and the ratio.
2. Weight sync: `RemoteRolloutEngine.load_weights` (encode, one POST, server-side decode, validation
   and swap) for the `--model` model and for a ~100M-parameter random Qwen2 (fp32, built in a temp
   folder), against a plain socket send of the same number of bytes over 127.0.0.1. Prints the ratio.
Timings are medians; they only mean something on an otherwise idle machine. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from alignrl.serve.process import ServiceProcess


def throughput(url: str, prompts: list[list[int]], clients: int, n: int, max_tokens: int) -> tuple[float, float, float]:
    """(seconds, sequences/s, tokens/s) for all prompts sent by `clients` threads."""
    tokens = []

    def one(p):
        r = httpx.post(url + "/v1/generate_tokens", json={"prompts": [p], "n": n, "max_tokens": max_tokens,
                                                           "temperature": 1.0}, timeout=600)
        r.raise_for_status()
        tokens.append(sum(len(o["token_ids"]) for o in r.json()["outputs"]))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, prompts))
    dt = time.perf_counter() - t0
    return dt, len(prompts) * n / dt, sum(tokens) / dt


def raw_loopback(nbytes: int) -> float:
    """Seconds to send `nbytes` over a loopback TCP socket into a preallocated buffer."""
    payload = bytes(nbytes)
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    done = threading.Event()

    def receive():
        conn, _ = srv.accept()
        buf, view, got = bytearray(nbytes), None, 0
        view = memoryview(buf)
        while got < nbytes:
            got += conn.recv_into(view[got:], min(1 << 20, nbytes - got))
        conn.sendall(b"k")
        conn.close()
        done.set()

    t = threading.Thread(target=receive)
    t.start()
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(payload)
        c.recv(1)
    dt = time.perf_counter() - t0
    t.join()
    srv.close()
    return dt


def weight_sync(folder: Path, label: str, repeats: int = 3) -> None:
    from alignrl.models.loader import load_model
    from alignrl.rollout.remote import RemoteRolloutEngine
    from alignrl.wire.http_weights import encode

    model, tok = load_model(str(folder), log=lambda *a: None)
    named = list(model.named_parameters())
    nparams = sum(t.numel() for _, t in named)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    with ServiceProcess(["generate", "--model", str(folder)], startup_s=600) as s:
        eng = RemoteRolloutEngine(s.url, tok)
        eng.manifest()  # fetched once per engine; not part of a sync
        syncs, encodes, server = [], [], []
        for v in range(1, repeats + 1):
            t0 = time.perf_counter()
            encode(named, v)
            encodes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            eng.load_weights(named, version=100 + v)
            syncs.append(time.perf_counter() - t0)
            server.append(httpx.get(s.url + "/v1/stats").json()["weight_updates"])
        assert server[-1] == repeats and eng.weight_version() == 100 + repeats
    raw = statistics.median(raw_loopback(nbytes) for _ in range(repeats))
    sync = statistics.median(syncs)
    print(f"weight sync [{label}]: {nparams / 1e6:.1f}M params, {nbytes / 2**20:.1f} MiB in 1 request: "
          f"{sync * 1000:.1f} ms (encode {statistics.median(encodes) * 1000:.1f} ms); raw loopback socket copy "
          f"of the same bytes {raw * 1000:.1f} ms; ratio sync/raw = {sync / raw:.2f}x")


def random_qwen2(tokenizer_from: Path, out: Path, hidden: int = 768, intermediate: int = 2048, layers: int = 12,
                 heads: int = 12, dtype=None) -> Path:
    """A random Qwen2 (32k vocabulary, 4 key/value heads, tied embeddings; ~100M parameters by default) saved in
    `out` in `dtype` (default fp32), with the tokenizer of `tokenizer_from`."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_from))
    cfg = Qwen2Config(vocab_size=32000, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=4, max_position_embeddings=1024,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).to(dtype or torch.float32).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", help="HF folder or 'demo' (the embedded demo model)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--n", type=int, default=4, help="samples per request")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--skip-100m", action="store_true")
    args = ap.parse_args()

    from alignrl.data import synthetic
    from alignrl.data.collate import encode_prompts
    from alignrl.models.loader import resolve_model_path
    from transformers import AutoTokenizer

    folder = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(str(folder))
    prompts = encode_prompts(tok, synthetic.generate("test", args.requests, seed=0), 128)
    with ServiceProcess(["generate", "--model", str(folder)]) as s:
        throughput(s.url, prompts[:args.clients], args.clients, args.n, args.max_tokens)  # warm-up
        t1, seq1, tok1 = throughput(s.url, prompts, 1, args.n, args.max_tokens)
        before = httpx.get(s.url + "/v1/stats").json()
        tk, seqk, tokk = throughput(s.url, prompts, args.clients, args.n, args.max_tokens)
        after = httpx.get(s.url + "/v1/stats").json()
    calls = after["engine_calls"] - before["engine_calls"]
    print(f"model: {folder}")
    print(f"throughput, {args.requests} requests x n={args.n}, <= {args.max_tokens} new tokens each:")
    print(f"  1 client : {t1:6.2f} s  {seq1:7.1f} seq/s  {tok1:8.1f} tok/s")
    print(f"  {args.clients} clients: {tk:6.2f} s  {seqk:7.1f} seq/s  {tokk:8.1f} tok/s  "
          f"({args.requests} requests in {calls} engine calls)")
    print(f"  ratio {args.clients} clients / 1 client = {seqk / seq1:.2f}x (sequences/s)")
    weight_sync(folder, args.model)
    if not args.skip_100m:
        tmp = Path(tempfile.mkdtemp(prefix="alignrl-bench-"))
        try:
            weight_sync(random_qwen2(folder, tmp / "qwen2-100m"), "random Qwen2 ~100M")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
