"""GRPO with LoRA adapters in the in-process placement: only the adapters train, the reference is the base with the
adapters off, the engine generates from the merged weights, checkpoints resume exactly and export as asked."""

import json

import pytest
import torch
from safetensors.torch import load_file

from alignrl.models import lora
from alignrl.models.loader import load_model
from alignrl.runner import train_grpo
from conftest import checkpoint_dir, recording_copy, run_settings, small_grpo

LORA = ["actor.kl_loss_coef=0.1", "actor.use_kl_loss=true", "model.lora_rank=4", "model.lora_alpha=8"]


def _cfg(model_dir, out, name, steps, *extra):
    return small_grpo(model_dir, *LORA, *run_settings(out, name, steps), "trainer.save_freq=1", *extra)


def test_lora_trains_only_adapters_and_exports_merged(tiny_model_dir, tmp_path):
    train_grpo(_cfg(tiny_model_dir, tmp_path, "run", 2))
    ckpt = checkpoint_dir(tmp_path, "run", 2)
    base = load_file(tiny_model_dir / "model.safetensors")
    merged = load_file(ckpt / "model" / "model.safetensors")
    assert merged.keys() == base.keys()  # a plain HF folder: the base's names
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    # only layers with adapters moved (all-linear: the projections), never embeddings, norms or biases
    assert changed and all(k.endswith("proj.weight") for k in changed), sorted(changed)
    trained = load_file(ckpt / "model_state" / lora.TRAINED_FILE)
    assert trained and all("lora_" in k for k in trained)
    assert (ckpt / "model_state" / lora.ADAPTER_DIR / "adapter_config.json").is_file()
    rows = [json.loads(x) for x in (tmp_path / "run" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["actor/kl_loss"] == 0.0 or rows[1]["actor/kl_loss"] < 1e-6  # step 1: policy == base
    assert rows[2]["actor/kl_loss"] > 0  # step 2: the adapters moved it away from the reference (adapters off)


def test_lora_resume_equals_straight_run(tiny_model_dir, tmp_path):
    train_grpo(_cfg(tiny_model_dir, tmp_path, "straight", 2))
    train_grpo(_cfg(tiny_model_dir, tmp_path, "halted", 1))
    train_grpo(_cfg(tiny_model_dir, tmp_path, "halted", 2, "trainer.resume_mode=auto"))
    a = load_file(checkpoint_dir(tmp_path, "straight", 2) / "model_state" / lora.TRAINED_FILE)
    b = load_file(checkpoint_dir(tmp_path, "halted", 2) / "model_state" / lora.TRAINED_FILE)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_a_resume_with_adapters_on_other_modules_names_the_checkpoints(tiny_model_dir, tmp_path):
    """A LoRA default that changed between the run that saved and the one resuming (all-linear against PEFT's
    per-architecture q_proj,v_proj): the one line names the modules to give."""
    from alignrl.models.folder import ModelError

    def adapted(targets):
        return lora.add_adapters(load_model(str(tiny_model_dir))[0], lora.lora_spec(4, target_modules=targets))

    saved = adapted("q_proj,v_proj")
    lora.save_trained(saved, saved.state_dict(), tmp_path)
    assert lora.load_trained(adapted("v_proj,q_proj"), tmp_path)  # the same modules, in any order
    with pytest.raises(ModelError) as e:
        lora.load_trained(adapted("all-linear"), tmp_path)
    assert "resume with its adapters' modules: model.target_modules=[q_proj,v_proj] (TRL's --lora_target_modules " \
           "q_proj v_proj, OpenRLHF's --target_modules q_proj v_proj); this run puts them on down_proj,gate_proj," \
           "k_proj,o_proj,q_proj,up_proj,v_proj" in str(e.value), str(e.value)


def test_a_resume_over_another_base_or_other_adapter_settings_is_one_line(tiny_model_dir, tmp_path):
    """trained.safetensors holds the adapters alone: the base they trained over (its weights' digest, its
    quantization) and their rank and scale are written beside them, and a resume that differs is one line."""
    import shutil

    from alignrl.models.folder import ModelError

    def adapted(folder, alpha=8):
        return lora.add_adapters(load_model(str(folder))[0], lora.lora_spec(4, alpha, target_modules="q_proj,v_proj"))

    saved = adapted(tiny_model_dir)
    lora.save_trained(saved, saved.state_dict(), tmp_path / "state")
    assert lora.load_trained(adapted(tiny_model_dir), tmp_path / "state")
    with pytest.raises(ModelError, match="holds adapters of r=4, lora_alpha=8, use_rslora=False and this run's are "
                                         "r=4, lora_alpha=16, use_rslora=False: resume with the model.lora_rank and "
                                         "model.lora_alpha that wrote it"):
        lora.load_trained(adapted(tiny_model_dir, alpha=16), tmp_path / "state")
    other = tmp_path / "other"  # the same names and shapes, other weights
    shutil.copytree(tiny_model_dir, other)
    model = load_model(str(tiny_model_dir))[0]
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(2)
    model.save_pretrained(str(other))
    with pytest.raises(ModelError, match="holds adapters trained over other base weights than this run's: resume with "
                                         r"the model.path \(or critic.model_path\) that wrote it"):
        lora.load_trained(adapted(other), tmp_path / "state")


# peft's own loader asks transformers 5 for `is_gradient_checkpointing`, which warns that it is deprecated: not ours
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_adapter_export_loads_with_peft(tiny_model_dir, tmp_path):
    from peft import PeftModel

    train_grpo(_cfg(tiny_model_dir, tmp_path, "run", 1, "model.lora_export=adapter"))
    folder = checkpoint_dir(tmp_path, "run", 1) / "model"
    assert (folder / "adapter_config.json").is_file() and not (folder / "model.safetensors").exists()
    base, _ = load_model(str(tiny_model_dir))
    model = PeftModel.from_pretrained(base, str(folder))
    trained = load_file(checkpoint_dir(tmp_path, "run", 1) / "model_state" / lora.TRAINED_FILE)
    mine = dict(model.named_parameters())
    for k, v in trained.items():
        torch.testing.assert_close(mine[k], v, rtol=0, atol=0, msg=k)


def test_an_engine_copy_receives_the_merged_weights_and_after_a_step_only_the_merged_layers(tiny_model_dir):
    from alignrl.placements.build import build_ref

    actor, copy, sink, sent = recording_copy(small_grpo(tiny_model_dir, *LORA), tiny_model_dir)
    assert set(lora.trainable_names(actor.model)) == {n for n, _ in actor.model.named_parameters() if "lora_" in n}
    assert len(actor.engine.params) == len(lora.trainable_names(actor.model))  # the optimizer: adapters alone
    with torch.no_grad():  # as a step would: the adapters move (B leaves zero)
        for n, p in actor.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    sink.publish(1)
    merged = lora.merged_state_dict(actor.model)
    mine = copy.state_dict()
    assert set(merged) == set(mine)
    for k, v in merged.items():
        assert torch.equal(mine[k], v), k
    assert any(not torch.equal(model_t, base_t) for model_t, base_t in zip(
        merged.values(), load_model(str(tiny_model_dir))[0].state_dict().values()))
    sink.publish(2)
    assert len(sent[0]) == len(list(copy.parameters()))  # first: every parameter
    assert sent[1] and all(n.endswith("proj.weight") for n in sent[1])  # then the layers the adapters merge into
    # the reference: the trained model with its adapters off is the base model exactly
    ref = build_ref(small_grpo(tiny_model_dir, *LORA, "actor.use_kl_loss=true"), torch.device("cpu"),
                    policy=actor.model)
    base_ref = build_ref(small_grpo(tiny_model_dir, *LORA, "actor.use_kl_loss=true"), torch.device("cpu"))
    ids = torch.randint(3, 200, (2, 5))
    mask = torch.ones_like(ids, dtype=torch.bool)
    a = ref.logprobs(ids, mask, ids, mask)
    b = base_ref.logprobs(ids, mask, ids, mask)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    policy = ref.scorer.logprobs(ids, mask, ids, mask)  # the same scorer, adapters on again: the trained policy
    assert (policy - a).abs().max() > 1e-4


def test_ppo_critic_with_adapters_trains_its_head_and_adapters_and_resumes_exactly(tiny_model_dir, tmp_path):
    """With LoRA the critic trains adapters and its new value head (whole); its checkpoint folder is a plain value
    model with the adapters merged in, and a resume continues exactly."""
    ppo = ["algorithm.adv_estimator=gae", "critic.enable=true", "critic.lr=1e-2"]
    train_grpo(_cfg(tiny_model_dir, tmp_path, "straight", 2, *ppo))
    train_grpo(_cfg(tiny_model_dir, tmp_path, "halted", 1, *ppo))
    train_grpo(_cfg(tiny_model_dir, tmp_path, "halted", 2, *ppo, "trainer.resume_mode=auto"))
    trained = load_file(checkpoint_dir(tmp_path, "straight", 2) / "critic_state" / lora.TRAINED_FILE)
    assert any("score" in k for k in trained) and any("lora_" in k for k in trained)
    assert not any("lora_" in k for k in trained if "score" in k)  # the head trains whole, without an adapter
    critic = load_file(checkpoint_dir(tmp_path, "straight", 2) / "critic" / "model.safetensors")
    assert "score.weight" in critic and not any("lora_" in k or "base_layer" in k for k in critic)
    for part in ("critic_state", "model_state"):
        a = load_file(checkpoint_dir(tmp_path, "straight", 2) / part / lora.TRAINED_FILE)
        b = load_file(checkpoint_dir(tmp_path, "halted", 2) / part / lora.TRAINED_FILE)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=f"{part}: {k}")
