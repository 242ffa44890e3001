"""Prompts with images in the placements that run the producer elsewhere, with the tiny Qwen2-VL model: a ZeroMQ
sampler process (its batches carry their image tensors as raw frames) trains as the in-process loop does, and Ray
rollout engines hand their batches, images included, to the actor ranks."""

import json
import math

import pytest
import torch

from alignrl.config import load_config
from alignrl.models import logprobs
from alignrl.runner import train_grpo
from alignrl.runtime.ports import free_ports
from visionrows import REWARD, color_rows, save_pictures, write_jsonl
from zmqpipeline import finish, sampler, spawn, weights


@pytest.fixture(scope="module")
def vl_run(tmp_path_factory):
    """(tiny VL folder, LMM-R1 data file, reward spec) for the runs below."""
    from alignrl.models.tiny_vl import build_tiny_vl

    root = tmp_path_factory.mktemp("vl_run")
    folder = build_tiny_vl(root / "tiny-vl", seed=0)
    write_jsonl(root / "train.jsonl", color_rows(save_pictures(root)))
    (root / "reward.py").write_text(REWARD)
    return folder, root / "train.jsonl", f"{root / 'reward.py'}:compute_score"


def overrides(vl_run, out, name, *extra):
    folder, data, reward = vl_run
    return [f"model.path={folder}", f"data.train_files={data}", f"data.val_files={data}", "data.prompt_key=message",
            "data.label_key=answer", "data.train_batch_size=2", "data.max_prompt_length=64", "rollout.n=2",
            "rollout.max_new_tokens=6", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=4",
            "actor.lr=1e-2", "actor.kl_loss_coef=0.01", f"algorithm.reward_fn={reward}",
            "trainer.total_training_steps=1", "trainer.test_freq=0", "trainer.save_freq=1", "trainer.progress_bar=false",
            "trainer.logger=[jsonl]", "trainer.threads=1", f"trainer.output_dir={out}",
            f"trainer.experiment_name={name}", *extra]


@pytest.mark.timeout(400)
def test_zmq_sampler_with_images_trains_as_in_process(vl_run, tmp_path):
    """The same step as in one process, with a KL loss whose reference log-probs the trainer scores
    (pipeline.ref_logprobs=trainer): the sampler holds no reference, and the trainer scores every row with the
    images its batch carried (image tokens without them would be refused)."""
    ports = free_ports(2)
    train_grpo(load_config(None, overrides(vl_run, tmp_path, "inline", "actor.use_kl_loss=true")))
    trainer = spawn("train", "grpo", *overrides(vl_run, tmp_path, "zmq", "pipeline.placement=zmq",
                                                "actor.use_kl_loss=true", "pipeline.ref_logprobs=trainer",
                                                f"pipeline.data_port={ports[0]}", f"pipeline.sync_port={ports[1]}",
                                                "pipeline.peer_timeout_s=120"))
    finish(trainer, sampler(vl_run[0], ports))
    rows = [json.loads(x) for x in (tmp_path / "zmq" / "logs" / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["pipeline/ref_rows_trainer"] == 4 and last["rollout/kl_vs_trainer"] < 1e-6, last
    # before its one update the policy is the reference: the KL loss against it is a finite ~0
    assert math.isfinite(last["actor/kl_loss"]) and abs(last["actor/kl_loss"]) < 1e-4, last
    a, b = weights(tmp_path / "inline", 1), weights(tmp_path / "zmq", 1)
    for k in a:  # the same batch (images included): the same weights up to float rounding in the vision tower's
        # backward (about 6e-8 measured on a few norm weights; the language model's weights are equal bit for bit)
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    assert sum(not torch.equal(a[k], b[k]) for k in a if not k.startswith("visual.")) == 0


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
    from safetensors.torch import load_file

    from alignrl.compat import openrlhf_flags, openrlhf_keys
    from alignrl.compat.openrlhf_ppo_ray import main
    from raycluster import metric_rows

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


def test_in_process_run_resizes_images_within_data_max_pixels(vl_run, tmp_path):
    """The in-process placement loads the processor with data.min_pixels/max_pixels: a 56x56 picture (4 image
    tokens at the processor's own bounds) becomes one image token under max_pixels=28*28."""
    from alignrl.data.collate import encode_prompts
    from alignrl.data.prompts import load_task_data
    from alignrl.models.vision import processor_of
    from alignrl.placements.local import place

    tokens = {}
    for name, extra in (("own", []), ("small", ["data.min_pixels=784", "data.max_pixels=784"])):
        cfg = load_config(None, overrides(vl_run, tmp_path, name, *extra))
        placed = place(cfg, cfg.model.path)
        processor = processor_of(placed.tokenizer)
        # the rows loaded without a tokenizer (as the runner loads them unless it filters long prompts): only the
        # placement's processor sets the image size
        samples = load_task_data(cfg, None)[0][:1]
        ids = encode_prompts(placed.tokenizer, samples, cfg.data.max_prompt_length)[0]
        tokens[name] = sum(t == processor.image_token_id for t in ids)
        if extra:
            assert processor.image_processor.size["longest_edge"] == 784
    assert tokens == {"own": 4, "small": 1}, tokens


def test_shared_prompt_forwards_take_image_prompts_and_share_the_text_ones(vl_run, tmp_path, monkeypatch):
    """actor.share_prompt with prompts with and without images: a micro-batch holding images takes the plain forward
    (the shared one cannot carry pictures), a text-only one shares its prompt, and the step equals the run without
    sharing up to float rounding of the shared forward."""
    folder, data, reward = vl_run
    rows = [json.loads(x) for x in data.read_text().splitlines()][:2]
    text = {"message": json.dumps([{"role": "user", "content": "Which colour has no picture?"}]), "answer": "red"}
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [rows[0], text, rows[1], text])
    run = (folder, mixed, reward)  # in file order: one prompt with a picture, one without
    # micro-batches of one prompt's two samples: the image prompt's alone, the text prompt's alone
    extra = ("actor.ppo_micro_batch_size=2", "data.shuffle=false")
    train_grpo(load_config(None, overrides(run, tmp_path, "plain", *extra)))
    calls = {"shared": 0, "pictures": 0}

    def count(name, real):
        def forward(*args, **kw):
            images = args[5] if len(args) > 5 else kw.get("images")
            calls[name] += name == "shared" or images is not None
            return real(*args, **kw)
        monkeypatch.setattr(logprobs, real.__name__, forward)

    count("shared", logprobs._shared_prompt_logits)
    count("pictures", logprobs._response_logits)
    train_grpo(load_config(None, overrides(run, tmp_path, "shared", *extra, "actor.share_prompt=true")))
    assert calls["shared"] > 0 and calls["pictures"] > 0, calls
    logs = [json.loads((tmp_path / r / "logs" / "metrics.jsonl").read_text().splitlines()[-1])
            for r in ("plain", "shared")]
    for key in ("actor/entropy", "actor/grad_norm"):
        assert logs[1][key] == pytest.approx(logs[0][key], rel=1e-5), key
    a, b = weights(tmp_path / "plain", 1), weights(tmp_path / "shared", 1)
    for k in a:  # Adam's first step (lr 1e-2) moves a weight by about lr whatever its gradient's size, so the rounding
        # of a near-zero gradient shows at 1e-5 (one element of 29376 measured); 1e-4 is a hundredth of such a move
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-4, msg=k)
