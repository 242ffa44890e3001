"""A DeepSpeed checkpoint holds the weights once: in its HF folder. Below ZeRO-3 DeepSpeed's model states file would
hold the whole module again (and from ZeRO-2 on the frozen weights once more); it holds their fingerprints instead,
and a resume from the HF folder continues exactly as the run that was not interrupted. A checkpoint written the
older way (the module in the model states) still resumes; a model that does not hold the saved weights is one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import src_path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Each case in one process (DeepSpeed's start-up costs more than its steps): a step, the checkpoint as a run saves it
# (save_engine: model/ + model_state/), the same engine's state also saved the older way (DeepSpeed's own
# save_checkpoint, the module inside), a second step; then engines rebuilt from model/ (with LoRA: from the base and
# the trained tensors) resume from each and take that second step. RESULT lines carry what the test checks.
SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
sys.path.insert(0, {workers!r})
import engine_worker
from alignrl.models import lora
from alignrl.runtime.env import SINGLE
from alignrl.train.checkpoint import save_engine
from alignrl.train.engines import OptimSpec, build_engine
from alignrl.train.engines.deepspeed import TAG, WeightsNotTheCheckpoints

root = Path({root!r})
# big enough that the fingerprints and DeepSpeed's bookkeeping are a small part of the weights; tied embeddings
base = root / "base"
torch.manual_seed(0)
AutoModelForCausalLM.from_config(LlamaConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, tie_word_embeddings=True)).save_pretrained(base)


def engine(stage, bf16, adapters, path, trained=None):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if bf16 else torch.float32)
    model.config.use_cache = False
    if adapters:
        torch.manual_seed(1)
        model = lora.add_adapters(model, lora.lora_spec(4, target_modules=("q_proj", "v_proj")))
        if trained is not None:
            assert lora.load_trained(model, trained)
    spec = OptimSpec(lr=1e-2, weight_decay=0.01, total_steps=10, grad_clip=1.0, eps=1e-4)
    return build_engine("deepspeed", model, spec, SINGLE, zero_stage=stage, bf16=bf16)


def sizes(folder):
    return {{p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}}


for case in {cases!r}:
    stage, bf16, adapters = case["stage"], case["bf16"], case["lora"]
    # glob's characters in the run's path (a run named "exp[1]"): DeepSpeed globs for its files
    out = root / f"run[{{stage}}{{'b' if bf16 else ''}}{{'l' if adapters else ''}}]"
    first = engine(stage, bf16, adapters, base)
    exp = engine_worker.fixed_batch(first.model)
    engine_worker.update(first, exp, SINGLE)
    save_engine(first, out / "new", "model")
    (out / "old" / "model_state").mkdir(parents=True)
    first.module.save_checkpoint(str(out / "old" / "model_state"), tag=TAG)  # as the older save_state wrote it
    engine_worker.update(first, exp, SINGLE)
    want = first.full_state_dict()
    source = base if adapters else out / "new" / "model"
    trained = out / "new" / "model_state" if adapters else None
    same = {{}}
    for kind in ("new", "old"):
        again = engine(stage, bf16, adapters, source, trained)
        assert again.load_state(out / kind / "model_state")
        engine_worker.update(again, exp, SINGLE)
        got = again.full_state_dict()
        same[kind] = sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    moved = max(float((want[k].float() - v.float()).abs().max())
                for k, v in engine(stage, bf16, adapters, base).full_state_dict().items())
    refused = ""
    if case.get("wrong"):  # the base model's weights under the checkpoint's optimizer state
        try:
            engine(stage, bf16, adapters, base).load_state(out / "new" / "model_state")
        except WeightsNotTheCheckpoints as e:
            refused = str(e)
    print("RESULT " + json.dumps(dict(case=case, same=same, moved=moved, refused=refused,
                                      new=sizes(out / "new"), old=sizes(out / "old"))), flush=True)
"""

CASES = [dict(stage=0, bf16=False, lora=False), dict(stage=1, bf16=False, lora=False),
         dict(stage=2, bf16=False, lora=False, wrong=True), dict(stage=2, bf16=True, lora=False),
         dict(stage=2, bf16=False, lora=True)]
STATES = "model_state/deepspeed/mp_rank_00_model_states.pt"


def test_deepspeed_checkpoints_hold_the_weights_once_and_resume_exactly(tmp_path):
    script = SCRIPT.format(workers=str(Path(__file__).parent / "workers"), root=str(tmp_path), cases=CASES)
    env = {**{k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")},
           "PYTHONPATH": src_path(), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    results = [json.loads(x[len("RESULT "):]) for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert [x["case"] for x in results] == CASES, r.stdout[-3000:]
    for x in results:
        case, new, old = x["case"], x["new"], x["old"]
        what = json.dumps(case)
        assert x["moved"] > 1e-3, what  # two steps moved the weights: the exact agreement below is not vacuous
        assert x["same"] == {"new": True, "old": True}, what  # bit for bit, from either layout
        weights = new["model/model.safetensors"]  # with LoRA: the adapters merged in, as the base's size
        assert old[STATES] > new[STATES] + 0.95 * weights, what  # the module's copy (with LoRA: the frozen base's)
        if case["stage"] > 0:  # the optimizer state is in its own files: what remains is bookkeeping
            assert new[STATES] < 0.05 * weights, (what, new)
        if case.get("wrong"):
            assert x["refused"].startswith(f"{tmp_path / 'run[2]' / 'new' / 'model_state'}: the model does not hold "
                                           "the weights this optimizer state was saved with ("), x["refused"]
            assert "resume with the model settings that wrote it" in x["refused"]


def test_two_ranks_resume_from_the_fingerprinted_states(tiny_model_dir, tmp_path):
    """ZeRO-1 and ZeRO-2 over two gloo ranks (the engines' round trip: a step, saved as a checkpoint saves it, an
    engine rebuilt from the HF folder resumes: equal weights, and its next step the original's): rank 0 writes the
    model states, every rank reads them; each rank's optimizer shard beside them."""
    from conftest import run_group
    from alignrl.runtime.ports import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": "60", "PYTHONPATH": src_path(),
           "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", str(Path(__file__).parent / "workers" / "engine_worker.py"), "--engines",
           "deepspeed:1=roundtrip", "deepspeed:2=roundtrip", "--model", str(tiny_model_dir), "--out", str(tmp_path)]
    r = run_group(cmd, 240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    for tag in ("deepspeed1", "deepspeed2"):
        folder = tmp_path / f"ckpt_{tag}"
        weights = (folder / "model" / "model.safetensors").stat().st_size
        states = folder / "model_state" / "deepspeed"
        assert len(list(states.glob("zero_pp_rank_[01]_mp_rank_00_optim_states.pt"))) == 2
        # the tiny model's weights are small beside DeepSpeed's fixed bookkeeping: a tenth, not the whole again
        assert (states / "mp_rank_00_model_states.pt").stat().st_size < 0.1 * weights, tag
