"""Prompts with images in the placements that run the producer elsewhere, with the tiny Qwen2-VL model (conftest's
vl_run): a ZeroMQ sampler process (its batches carry their image tensors as raw frames) trains as the in-process loop
does. Ray rollout engines handing their batches, images included, to the actor ranks: test_ray_runs (on that module's
Ray cluster, so that no second cluster starts for it)."""

import json
import math

import pytest
import torch

from alignrl.config import load_config
from alignrl.models import logprobs
from alignrl.runner import train_grpo
from alignrl.runtime.ports import free_ports
from visionrows import write_jsonl
from zmqpipeline import finish, sampler, spawn, weights


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
