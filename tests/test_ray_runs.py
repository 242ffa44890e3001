"""Short runs on the two-node Ray cluster of the Ray tests, one cluster for the module (starting and stopping one is
a good part of a short run's time): seed 001's reference group holding one sharded copy (--zero_stage 3) against
whole copies, an OpenRLHF script in its current dotted flags (test_openrlhf_dotted's spelling) training a step,
LoRA's merged weights on the Ray rollout engines (test_lora_rl_placements' other placements), and prompts with images
crossing Ray (test_vision_placements' other placements)."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("ray")
from alignrl.compat.openrlhf_ppo_ray import main  # noqa: E402
from alignrl.config import load_config  # noqa: E402
from alignrl.runner import train_grpo  # noqa: E402
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
        argv = tiny(tiny_model_dir, save, 1, "--ref_num_gpus_per_node", "2", "--zero_stage", stage,
                    "--vllm_num_engines", "2", "--ckpt_path", str(save / "ckpt"), "--use_tensorboard",
                    str(tmp_path / "tb"), "--eval_steps", "1")
        assert main(argv) == 0, capsys.readouterr().err
        said = capsys.readouterr().out
        assert ("one copy sharded over 2 ranks" in said) == (stage == "3"), said
        # the FSDP2 actor ranks (the ZeRO stages' stand-in without GPUs) build the policy in its shards
        assert "policy: built in FSDP2 shards over 2 ranks" in said, said
        weights = save / "ckpt" / "global_step_1" / "model" / "model.safetensors"
        finals[stage] = load_file(weights)
        # as OpenRLHF: the trained model in --save_path (a copy: a later save there leaves the checkpoint as it
        # was), events in --use_tensorboard/<run>
        assert (save / "config.json").is_file() and (save / "tokenizer.json").is_file(), sorted(save.iterdir())
        assert (save / "model.safetensors").read_bytes() == weights.read_bytes()
        assert (save / "model.safetensors").stat().st_ino != weights.stat().st_ino
        assert list((tmp_path / "tb" / save.name).glob("events.out.tfevents.*"))
        rows = metric_rows(save)
        assert [r["step"] for r in rows if r["step"] > 0] == [1]
        vals[stage] = [{k: v for k, v in r.items() if k.startswith("val/")} for r in rows]
        assert all(vals[stage]), rows  # the base model's (step 0) and every step's
        summaries[stage] = json.loads((save / "summary.json").read_text())
    for k, v in finals["3"].items():
        torch.testing.assert_close(v, finals["2"][k], rtol=0, atol=1e-6, msg=k)
    assert vals["3"] == vals["2"]
    for key in ("base_accuracy", "final_accuracy"):
        assert summaries["3"][key] == summaries["2"][key], (summaries["3"], summaries["2"])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_dotted_openrlhf_script_trains_a_step(cluster, tiny_model_dir, tmp_path, capsys):
    """OpenRLHF's examples/scripts/train_reinforce_baseline_hybrid_engine.sh (OpenRLHF/OpenRLHF@63a4e4b61b03be251e41e
    500c925a590f8da6a5a), shrunk in paths, GPU counts, batch sizes and lengths, with --vllm.enable_sleep beside
    --fsdp.enable_sleep as that commit's own parser requires. Left out: its agent function and dynamic filtering's
    range (refused as unknown), its token budgets and IS-correction flags (tests/test_openrlhf_recent.py)."""
    from alignrl.data import synthetic

    data, save = tmp_path / "prompts.json", tmp_path / "run"
    data.write_text(json.dumps([{"prompt": s.messages, "label": s.ground_truth}
                                for s in synthetic.generate("train", 16, seed=0)]))
    argv = ["--actor.model_name_or_path", str(tiny_model_dir), "--ckpt.load_enable", "--ckpt.output_dir", str(save),
            "--ckpt.path", str(save / "ckpt"), "--ckpt.save_hf", "--ckpt.max_num", "3", "--ckpt.save_steps", "10",
            "--data.prompt_dataset", str(data), "--data.input_key", "prompt", "--data.label_key", "label",
            "--data.max_len", "512", "--rollout.max_new_tokens", "8", "--data.apply_chat_template",
            "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4", "--train.batch_size", "8",
            "--train.micro_batch_size", "1", "--rollout.micro_batch_size", "8", "--data.max_samples", "16",
            "--train.max_epochs", "1", "--train.num_episodes", "1",
            "--ref.num_nodes", "1", "--ref.num_gpus_per_node", "2", "--actor.num_nodes", "1",
            "--actor.num_gpus_per_node", "2", "--vllm.num_engines", "1", "--vllm.tensor_parallel_size", "2",
            "--vllm.gpu_memory_utilization", "0.7", "--train.colocate_all", "--fsdp.enable_sleep", "--vllm.enable_sleep",
            "--vllm.sync_backend", "nccl", "--vllm.enforce_eager", "--actor.gradient_checkpointing_enable",
            "--fsdp.param_dtype", "bf16",
            "--algo.advantage.estimator", "reinforce_baseline", "--actor.adam.lr", "5e-7", "--actor.entropy_coef", "0.0",
            "--algo.kl.init_coef", "1e-5", "--algo.kl.use_loss", "--algo.kl.estimator", "k2",
            "--logger.tensorboard_dir", str(save / "runs"), "--logger.logging_steps", "1", "--eval.steps", "-1",
            # alignrl's own: one step, a small held-out set, short waits
            "--total_steps", "1", "--val_size", "4", "--peer_timeout", "60", "--placement_timeout", "20"]
    assert main(argv) == 0, capsys.readouterr().err[-3000:]
    assert (save / "ckpt" / "global_step_1").is_dir() and (save / "summary.json").is_file()


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_ray_rollout_engines_generate_from_the_merged_weights(cluster, tiny_model_dir, tmp_path, capsys):
    """OpenRLHF's --lora_rank on the two-node Ray cluster: two DDP actor ranks with adapters, one rollout engine
    holding a plain model, fed the merged weights by the broadcast (after the first publish only the layers the
    adapters merge into), against the in-process loop with the same flags (which generates through the adapters):
    the same weights, up to the ranks' reduction order and the merge's rounding."""
    from alignrl.compat import openrlhf_flags as F
    from alignrl.compat import openrlhf_keys as K

    argv = tiny(tiny_model_dir, tmp_path / "ray", 2, "--ckpt_path", str(tmp_path / "ckpt"), "--lora_rank", "4",
                "--lora_alpha", "8", "--actor_learning_rate", "1e-2", "--entropy_loss_coef", "0.05",
                "--lr_scheduler", "constant", "--train_batch_size", "16")  # one optimizer step a step
    assert main(argv) == 0, capsys.readouterr().err
    args = F.parser().parse_args(argv)
    train_grpo(load_config(None, K.overrides(args, gpus=False, total_steps=2) + [
        f"trainer.output_dir={tmp_path}", "trainer.experiment_name=inline", "trainer.checkpoint_dir=checkpoints"]))
    ray_w = load_file(tmp_path / "ckpt" / "global_step_2" / "model" / "model.safetensors")
    inline = load_file(tmp_path / "inline" / "checkpoints" / "global_step_2" / "model" / "model.safetensors")
    base = load_file(tiny_model_dir / "model.safetensors")
    moved = {k for k in base if not torch.equal(base[k], ray_w[k])}
    assert moved and all(k.endswith("proj.weight") for k in moved), sorted(moved)  # adapters only
    for k in inline:
        torch.testing.assert_close(ray_w[k], inline[k], rtol=0, atol=2e-5, msg=k)


@pytest.mark.timeout(400)
def test_ray_placement_with_images_trains_the_step_of_one_process(cluster, vl_run, tmp_path, capsys):
    """`alignrl train ppo-ray` (OpenRLHF's flags, LMM-R1's `--input_key message`) with the tiny VL model: two
    actor ranks, a rollout engine whose batches carry the prompts' images across Ray, a reference worker of its
    own scoring them with their images for the KL loss, and a critic group of two ranks (PPO with gae, the critic
    from the policy's folder) reading them for its values. The step is the one the same run takes in one process:
    every metric of the step (losses, entropy, values, returns and both gradient norms, which carry the gradients'
    scale) within 1e-5 relative, and the weights within 5e-4 of a step of ~1e-2 (Adam's first step at lr 1e-2 is
    lr·g/(|g| + 1e-8): where two ranks' partial sums cancel to ~1e-8, their float order moves it; measured 7.5e-5
    policy, 7e-6 critic). Another batch, reward or missed update moves weights by ~1e-2."""
    from alignrl.compat import openrlhf_flags, openrlhf_keys

    folder, data, _ = vl_run
    argv = ["--pretrain", str(folder), "--save_path", str(tmp_path / "ray"), "--ckpt_path", str(tmp_path / "ckpt"),
            "--actor_num_nodes", "1",
            "--actor_num_gpus_per_node", "2", "--vllm_num_engines", "1", "--advantage_estimator", "gae",
            "--critic_pretrain", str(folder), "--critic_num_nodes", "1", "--critic_num_gpus_per_node", "2",
            "--critic_learning_rate", "1e-2",
            "--n_samples_per_prompt", "4", "--rollout_batch_size", "2", "--train_batch_size", "8",
            "--micro_train_batch_size", "4", "--generate_max_len", "6", "--prompt_max_len", "64", "--max_samples", "4",
            "--actor_learning_rate", "1e-2", "--val_size", "2", "--total_steps", "1", "--peer_timeout", "60",
            "--placement_timeout", "20", "--prompt_data", str(data), "--input_key", "message", "--label_key", "answer",
            "--apply_chat_template", "--use_kl_loss", "--init_kl_coef", "0.01", "--ref_num_nodes", "1",
            "--ref_num_gpus_per_node", "1"]
    assert main(argv) == 0, capsys.readouterr().err
    rows = [r for r in metric_rows(tmp_path / "ray") if r["step"] == 1]
    # the actor ranks' recomputed log-probs (with the images that crossed Ray) are the engine's
    assert rows and rows[0]["rollout/kl_vs_trainer"] < 1e-6 and "actor/entropy" in rows[0], rows
    # the reference worker read the images: its log-probs are the base policy's, so before the one update the
    # KL loss of the policy against it is a finite ~0 (image tokens without their images would have been refused)
    assert math.isfinite(rows[0]["actor/kl_loss"]) and abs(rows[0]["actor/kl_loss"]) < 1e-4, rows
    assert math.isfinite(rows[0]["actor/grad_norm"]) and rows[0]["actor/grad_norm"] > 0, rows  # the step trained
    # the critic ranks read the images too (a text-only critic is refused), and trained
    assert math.isfinite(rows[0]["critic/values_mean"]) and rows[0]["critic/grad_norm"] > 0, rows
    inline = train_grpo(load_config(None, openrlhf_keys.overrides(openrlhf_flags.parser().parse_args(argv), False, 1)
                                    + [f"trainer.output_dir={tmp_path}", "trainer.experiment_name=inline",
                                       "trainer.checkpoint_dir=checkpoints"]))
    ray_summary = json.loads((tmp_path / "ray" / "summary.json").read_text())  # evaluated on the rollout engine
    for key in ("base_accuracy", "final_accuracy"):
        assert ray_summary[key] == inline[key], (ray_summary, inline)
    one = next(r for r in metric_rows(tmp_path / "inline") if r["step"] == 1)
    compared = [k for k, v in one.items() if isinstance(v, float) and not k.startswith(("timing/", "perf/"))]
    assert {"actor/grad_norm", "critic/grad_norm", "actor/kl_loss", "critic/vf_loss"} <= set(compared), compared
    for k in compared:
        assert math.isclose(rows[0][k], one[k], rel_tol=1e-5, abs_tol=1e-7), (k, rows[0][k], one[k])
    worst, base = {}, load_file(folder / "model.safetensors")  # the policy's and the critic's starting point
    for part in ("model", "critic"):
        a, b = (load_file(root / "global_step_1" / part / "model.safetensors")
                for root in (tmp_path / "ckpt", tmp_path / "inline" / "checkpoints"))
        assert any(not torch.equal(a[k], base[k]) for k in a if k in base), f"the step did not train the {part}"
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=5e-4, msg=f"{part}: {k}")
        worst[part] = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"max |ray - one process| after the step: {worst}")
