"""Seed 001's reference group holding one sharded copy (--zero_stage 3) on the two-node Ray cluster of the Ray
tests, against whole copies."""

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("ray")
from alignrl.cluster.train_ppo_ray import main  # noqa: E402
from raycluster import metric_rows, tiny  # noqa: E402


@pytest.mark.timeout(400)
def test_a_sharded_reference_group_trains_as_whole_copies_do(cluster, tiny_model_dir, tmp_path, capsys):
    """--zero_stage 3 with two reference ranks: one copy of the reference sharded over them (FSDP, as OpenRLHF's
    ZeRO-3 reference group; each of the two engines' calls reaches both ranks, in whatever order they arrive),
    against two whole copies (--zero_stage 2).
    The reference log-probs are the same numbers (tests/test_sharded_ref.py: exactly), so are the weights."""
    finals = {}
    for stage in ("3", "2"):
        save = tmp_path / f"zero{stage}"
        argv = tiny(tiny_model_dir, save, 2, "--ref_num_gpus_per_node", "2", "--zero_stage", stage,
                    "--vllm_num_engines", "2", "--ckpt_path", str(save / "ckpt"), "--use_tensorboard",
                    str(tmp_path / "tb"))
        assert main(argv) == 0, capsys.readouterr().err
        said = capsys.readouterr().out
        assert ("one copy sharded over 2 ranks" in said) == (stage == "3"), said
        weights = save / "ckpt" / "global_step_2" / "model" / "model.safetensors"
        finals[stage] = load_file(weights)
        # as OpenRLHF: the trained model in --save_path (a copy: a later save there leaves the checkpoint as it
        # was), events in --use_tensorboard/<run>
        assert (save / "config.json").is_file() and (save / "tokenizer.json").is_file(), sorted(save.iterdir())
        assert (save / "model.safetensors").read_bytes() == weights.read_bytes()
        assert (save / "model.safetensors").stat().st_ino != weights.stat().st_ino
        assert list((tmp_path / "tb" / save.name).glob("events.out.tfevents.*"))
        assert [r["step"] for r in metric_rows(save) if r["step"] > 0] == [1, 2]
    for k, v in finals["3"].items():
        torch.testing.assert_close(v, finals["2"][k], rtol=0, atol=1e-6, msg=k)
