"""Seed 001's reference group holding one sharded copy (--zero_stage 3) on the two-node Ray cluster of the Ray
tests, against whole copies."""

import json

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("ray")
from alignrl.compat.openrlhf_ppo_ray import main  # noqa: E402
from raycluster import metric_rows, tiny  # noqa: E402


@pytest.mark.timeout(400)
def test_a_sharded_reference_group_trains_as_whole_copies_do(cluster, tiny_model_dir, tmp_path, capsys):
    """--zero_stage 3 with two reference ranks: one copy of the reference sharded over them (FSDP, as OpenRLHF's
    ZeRO-3 reference group; each of the two engines' calls reaches both ranks, in whatever order they arrive),
    against two whole copies (--zero_stage 2).
    The reference log-probs are the same numbers (tests/test_sharded_ref.py: exactly), so are the weights, and so
    are the held-out evaluations, which run on the two rollout engines (no actor rank holds a full copy for them,
    though the ZeRO-3 actor keeps only shards)."""
    finals, summaries, vals = {}, {}, {}
    for stage in ("3", "2"):
        save = tmp_path / f"zero{stage}"
        argv = tiny(tiny_model_dir, save, 2, "--ref_num_gpus_per_node", "2", "--zero_stage", stage,
                    "--vllm_num_engines", "2", "--ckpt_path", str(save / "ckpt"), "--use_tensorboard",
                    str(tmp_path / "tb"), "--eval_steps", "1")
        assert main(argv) == 0, capsys.readouterr().err
        said = capsys.readouterr().out
        assert ("one copy sharded over 2 ranks" in said) == (stage == "3"), said
        # the FSDP2 actor ranks (the ZeRO stages' stand-in without GPUs) build the policy in its shards
        assert "policy: built in FSDP2 shards over 2 ranks" in said, said
        weights = save / "ckpt" / "global_step_2" / "model" / "model.safetensors"
        finals[stage] = load_file(weights)
        # as OpenRLHF: the trained model in --save_path (a copy: a later save there leaves the checkpoint as it
        # was), events in --use_tensorboard/<run>
        assert (save / "config.json").is_file() and (save / "tokenizer.json").is_file(), sorted(save.iterdir())
        assert (save / "model.safetensors").read_bytes() == weights.read_bytes()
        assert (save / "model.safetensors").stat().st_ino != weights.stat().st_ino
        assert list((tmp_path / "tb" / save.name).glob("events.out.tfevents.*"))
        rows = metric_rows(save)
        assert [r["step"] for r in rows if r["step"] > 0] == [1, 2]
        vals[stage] = [{k: v for k, v in r.items() if k.startswith("val/")} for r in rows]
        assert all(vals[stage]), rows  # the base model's (step 0) and every step's
        summaries[stage] = json.loads((save / "summary.json").read_text())
    for k, v in finals["3"].items():
        torch.testing.assert_close(v, finals["2"][k], rtol=0, atol=1e-6, msg=k)
    assert vals["3"] == vals["2"]
    for key in ("base_accuracy", "final_accuracy"):
        assert summaries["3"][key] == summaries["2"][key], (summaries["3"], summaries["2"])
