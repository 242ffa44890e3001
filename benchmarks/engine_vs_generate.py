#!/usr/bin/env python
"""Seconds per batch: alignrl's embedded rollout engine vs `model.generate`, same model and batch.

    python benchmarks/engine_vs_generate.py [--model PATH] [--prompts 32] [--n 8] [--max-new-tokens 40]

Both decode the same left-padded prompts (each repeated n times) with a KV cache, stopping at eos,
sampling at temperature 1 (and, separately, greedy). Runs alternate engine / generate so both share
whatever else the machine is doing; the first round is warm-up. Prints the median seconds of each,
the generated tokens, and the ratio generate/engine (> 1: the engine is faster); greedy outputs are
checked token for token against `model.generate`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from alignrl.data import synthetic
from alignrl.data.collate import encode_prompts, left_pad
from alignrl.models.loader import load_model
from alignrl.rollout.hf_engine import HFRolloutEngine, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", help="HF folder or 'demo' (the embedded tiny model)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()

    model, tok = load_model(args.model)
    model.eval()
    prompts = encode_prompts(tok, synthetic.generate("test", args.prompts, seed=0), 128)
    engine = HFRolloutEngine(model, tok)
    ids, mask = left_pad([p for p in prompts for _ in range(args.n)], tok.pad_token_id)

    for label, temperature in (("sampling T=1", 1.0), ("greedy", 0.0)):
        times: dict[str, list[float]] = {"engine": [], "generate": []}
        tokens: dict[str, int] = {}
        for r in range(args.rounds):
            t0 = time.perf_counter()
            ro = engine.generate(prompts, SamplingParams(n=args.n, temperature=temperature,
                                                         max_new_tokens=args.max_new_tokens, seed=r))
            times["engine"].append(time.perf_counter() - t0)
            tokens["engine"] = int(ro.response_mask.sum())
            torch.manual_seed(r)
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=args.max_new_tokens,
                                     do_sample=temperature > 0, temperature=temperature or None, top_k=0,
                                     top_p=1.0, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            times["generate"].append(time.perf_counter() - t0)
            resp = out[:, ids.shape[1]:]
            # tokens up to and including the first eos
            is_eos = (resp == tok.eos_token_id).long()
            tokens["generate"] = int(((is_eos.cumsum(1) - is_eos) == 0).sum())
            if temperature == 0:
                same = all(ro.response_ids[i, :int(ro.response_mask[i].sum())].tolist()
                           == resp[i, :int(ro.response_mask[i].sum())].tolist() for i in range(len(resp)))
                if not same:
                    raise SystemExit("greedy outputs differ between the engine and model.generate")
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        print(f"{label}: {args.prompts} prompts x {args.n} = {args.prompts * args.n} sequences, "
              f"<= {args.max_new_tokens} new tokens")
        for k in ("engine", "generate"):
            print(f"  {k:9s} median {med[k]:.3f}s  ({tokens[k]} tokens generated, {tokens[k] / med[k]:.0f} tok/s)")
        print(f"  ratio generate/engine = {med['generate'] / med['engine']:.2f}x")


if __name__ == "__main__":
    main()
