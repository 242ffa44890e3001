"""The reference moved toward the policy during RL (actor.ref_sync_steps, actor.ref_mixup_alpha; TRL's GRPO
sync_ref_model, verl forks' actor_rollout_ref.ref.sync_ref_model): the saved reference is the mix of the policy and
the reference before it, a resumed run reloads it, and the runs it cannot apply to are one line."""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from alignrl.config import ConfigError, load_config
from alignrl.runner import train_grpo
from smallrun import overrides, weights

SYNC = ["actor.ref_sync_steps=2", "actor.ref_mixup_alpha=0.5", "actor.kl_loss_coef=1.0", "trainer.max_checkpoints=0",
        "actor.lr_scheduler=constant"]


def _reference(run, step: int) -> dict:
    return load_file(run / "checkpoints" / f"global_step_{step}" / "reference" / "model.safetensors")


def _base(model_dir) -> dict:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(str(model_dir)).named_parameters())


def test_the_reference_is_the_mix_at_every_sync_and_a_resume_reloads_it(tiny_model_dir, tmp_path):
    straight = overrides(tiny_model_dir, tmp_path, "straight", 3, 1) + SYNC
    assert train_grpo(load_config(None, straight))["steps"] == 3
    run, base = tmp_path / "straight", _base(tiny_model_dir)
    assert not (run / "checkpoints" / "global_step_1" / "reference").exists()  # before the first sync: the base
    policy, synced = weights(run, 2), _reference(run, 2)  # the sync after update 2: half policy, half base
    for n, p in base.items():
        torch.testing.assert_close(synced[n], 0.5 * policy[n] + 0.5 * p.detach(), rtol=0, atol=1e-6)
    assert any(not torch.equal(synced[n], p.detach()) for n, p in base.items())
    assert all(torch.equal(_reference(run, 3)[n], synced[n]) for n in synced)  # update 3 is no sync step

    # two steps, then a resume to three: the same weights as the straight run, which a base reference would not give
    for name in ("resumed", "forgot"):
        train_grpo(load_config(None, overrides(tiny_model_dir, tmp_path, name, 2, 2) + SYNC))
    shutil.rmtree(tmp_path / "forgot" / "checkpoints" / "global_step_2" / "reference")
    from alignrl.train.checkpoint import write_manifest

    write_manifest(tmp_path / "forgot" / "checkpoints" / "global_step_2")
    for name in ("resumed", "forgot"):
        train_grpo(load_config(None, overrides(tiny_model_dir, tmp_path, name, 3, 3) + SYNC))
    want, got, without = weights(run, 3), weights(tmp_path / "resumed", 3), weights(tmp_path / "forgot", 3)
    assert all(torch.equal(want[n], got[n]) for n in want)
    assert any(not torch.equal(want[n], without[n]) for n in want)
    # resumed without the sync, the moved reference would silently become the base model again
    with pytest.raises(ConfigError, match="holds a reference moved toward the policy"):
        train_grpo(load_config(None, overrides(tiny_model_dir, tmp_path, "resumed", 4, 4) + SYNC[2:]
                               + ["actor.ref_sync_steps=0"]))


def test_weights_already_mixed_are_not_mixed_again():
    """The first publish after a resume (a generation service is sent the resumed weights) and a fresh run's first,
    of the base weights, leave the reference as it is."""
    from types import SimpleNamespace

    from alignrl.placements.ref_sync import ReferenceMix

    policy, reference = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    actor = SimpleNamespace(engine=SimpleNamespace(full_state_dict=lambda: dict(policy.state_dict())))
    mix, before = ReferenceMix(actor, reference, steps=2, alpha=0.5), reference.weight.detach().clone()
    mix.publish(0)
    assert torch.equal(reference.weight, before)
    mix.publish(2)
    once = reference.weight.detach().clone()
    torch.testing.assert_close(once, 0.5 * policy.weight.detach() + 0.5 * before)
    mix.publish(2)  # the same update published again
    assert torch.equal(reference.weight, once) and mix.mixed_at == 2


def test_a_saved_reference_loads_back_and_a_resume_with_another_mix_says_so(tmp_path, capsys):
    from types import SimpleNamespace

    from alignrl.placements.ref_sync import ReferenceMix

    policy, reference = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    actor = SimpleNamespace(engine=SimpleNamespace(full_state_dict=lambda: dict(policy.state_dict())))
    saver = ReferenceMix(actor, reference, steps=2, alpha=0.5)
    assert saver.save(tmp_path) is None and not (tmp_path / "reference").exists()  # still the base model
    saver.publish(4)
    assert saver.save(tmp_path) is None
    same, other = (ReferenceMix(actor, torch.nn.Linear(2, 2), steps=s, alpha=a) for s, a in ((2, 0.5), (3, 0.25)))
    same.load(tmp_path)
    assert "moves by" not in capsys.readouterr().out
    other.load(tmp_path)
    said = capsys.readouterr().out
    assert torch.equal(other.moving.params["weight"], reference.weight) and other.mixed_at == 4
    assert ("the reference moved by alpha=0.5 every 2 updates until update 4; it moves by alpha=0.25 every 3 updates "
            "from here") in said.replace("\n", " ")
    with pytest.raises(ConfigError, match="holds other weights than this run's reference model"):
        ReferenceMix(actor, torch.nn.Linear(2, 3), steps=2, alpha=0.5).load(tmp_path)


@pytest.mark.parametrize("extra, message", [
    (["actor.use_kl_loss=false"], "moves the reference, which this run never reads"),
    (["model.lora_rank=4"], "the policy with its adapters off"),
    (["services.reference_url=http://127.0.0.1:9"], "a service with weights of its own"),
    (["pipeline.placement=zmq"], "computes the reference's log-probs in the samplers"),
    (["actor.ref_mixup_alpha=0"], "out of range"),
])
def test_runs_that_cannot_move_the_reference_are_one_line(extra, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, ["actor.ref_sync_steps=4", *extra])
    assert "\n" not in str(e.value)


def test_verls_reference_sync_keys():
    base = ["actor_rollout_ref.actor.use_kl_loss=True"]
    on = load_config(None, base + ["actor_rollout_ref.ref.sync_ref_model=True",
                                   "actor_rollout_ref.ref.ref_model_sync_steps=8",
                                   "actor_rollout_ref.ref.ref_model_mixup_alpha=0.9"])
    assert (on.actor.ref_sync_steps, on.actor.ref_mixup_alpha) == (8, 0.9)
    defaults = load_config(None, base + ["actor_rollout_ref.ref.sync_ref_model=True"])  # TRL's defaults
    assert (defaults.actor.ref_sync_steps, defaults.actor.ref_mixup_alpha) == (512, 0.6)
    off = load_config(None, base + ["actor_rollout_ref.ref.sync_ref_model=False",
                                    "actor_rollout_ref.ref.ref_model_sync_steps=8"])
    assert off.actor.ref_sync_steps == 0


def test_a_ray_job_refuses_it_before_any_worker_starts():
    from alignrl.placements.ray.verl_job import run_on_ray

    cfg = load_config(None, ["actor.ref_sync_steps=4"])
    with pytest.raises(ConfigError, match="RAY_ADDRESS is set but actor.ref_sync_steps=4 moves a reference held by "
                                          "the trainer") as e:
        run_on_ray(cfg, "alignrl train grpo")
    assert "\n" not in str(e.value)
