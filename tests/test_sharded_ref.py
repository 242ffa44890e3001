"""A reference model sharded over two gloo ranks (FSDP2, as the Ray reference group holds it under ZeRO-3 or
verl's FSDP) scores the same log-probs as a whole copy, though the ranks get shares of different sizes (their
forwards are collective), and each rank holds about half of the weights."""

import json
import os
import sys
import time
from pathlib import Path

import pytest

from conftest import run_group, src_path
from alignrl.runtime.ports import free_port

WORKER = Path(__file__).parent / "workers" / "sharded_ref_worker.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def run_ranks(model_dir, out, *extra, collective_timeout: int = 60, timeout: int = 180):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": str(collective_timeout),
           "PYTHONPATH": src_path()}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", str(WORKER), "--model", str(model_dir), "--out", str(out), *extra]
    return run_group(cmd, timeout, env=env)


def test_a_sharded_reference_scores_what_a_whole_copy_does(tiny_model_dir, tmp_path):
    done = run_ranks(tiny_model_dir, tmp_path / "r")
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"r.{r}.json").read_text()) for r in (0, 1)]
    # the same weights in the same order of operations: equal up to the packed/shared layouts' own rounding
    assert all(r["worst"] <= 1e-6 for r in ranks), ranks
    total = ranks[0]["total"]
    assert sum(r["held"] for r in ranks) == total, ranks  # every weight on exactly one rank
    assert all(r["held"] < 0.6 * total for r in ranks), ranks


def test_a_rank_that_fails_part_way_stops_at_once(tiny_model_dir, tmp_path):
    """Its next call's collectives would pair with the rest of this one's on the other ranks: it ends its process
    with one line, and the group stops long before the collective timeout (300 s here: not waited out). The model is
    a folder of .bin weights, which cannot be read by rows: loaded whole, then sharded, it scores as a whole copy."""
    import shutil

    import torch

    from alignrl.models.loader import load_model

    bin_dir = tmp_path / "bin"
    shutil.copytree(tiny_model_dir, bin_dir)
    (bin_dir / "model.safetensors").unlink()
    whole = load_model(str(tiny_model_dir), "float32")[0]
    torch.save(whole.state_dict(), bin_dir / "pytorch_model.bin")
    t0 = time.monotonic()
    done = run_ranks(bin_dir, tmp_path / "r", "--fail", collective_timeout=300, timeout=220)
    assert done.returncode != 0 and time.monotonic() - t0 < 200, done.stderr[-2000:]
    said = [x for x in done.stderr.splitlines() if "a rank of a sharded reference cannot continue alone" in x]
    # rank 1 says why; rank 0, whose collective then failed, stops too (one line each at most)
    assert any(x.startswith("reference rank 1: IndexError") for x in said) and len(said) <= 2, done.stderr[-2000:]
    ranks = [json.loads((tmp_path / f"r.{r}.json").read_text()) for r in (0, 1)]
    total = sum(p.numel() for p in whole.parameters())
    assert all(r["worst"] <= 1e-6 for r in ranks) and sum(r["held"] for r in ranks) == total, ranks


def test_a_model_read_by_rows_is_the_model_loaded_whole(tiny_model_dir, tmp_path):
    """load_sharded with no sharding (one rank's rows are all rows): the same logits as transformers' load, so the
    buffers (rotary frequencies) and the tied embedding came through; a folder of .bin weights is not read by rows."""
    import shutil

    import torch

    from alignrl.models.loader import load_model
    from alignrl.models.sharded_load import load_sharded

    whole = load_model(str(tiny_model_dir), "float32")[0].eval()
    rows = load_sharded(tiny_model_dir, torch.float32, torch.device("cpu"), lambda m: None)
    assert rows is not None and not any(p.requires_grad for p in rows.parameters())
    assert rows.lm_head.weight is rows.model.embed_tokens.weight
    # what from_pretrained leaves besides the weights: a checkpoint saved from it keeps the folder's generation config
    assert rows.generation_config.to_dict() == whole.generation_config.to_dict() and not rows.config.use_cache
    ids = torch.randint(3, whole.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(rows(input_ids=ids).logits, whole(input_ids=ids).logits)
    bin_dir = tmp_path / "bin"
    shutil.copytree(tiny_model_dir, bin_dir)
    (bin_dir / "model.safetensors").unlink()
    torch.save(whole.state_dict(), bin_dir / "pytorch_model.bin")
    assert load_sharded(bin_dir, torch.float32, torch.device("cpu"), lambda m: None) is None
