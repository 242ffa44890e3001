"""actor.freeze_prefix (OpenRLHF's --freeze_prefix): frozen parameters keep their values bit for bit, hold no optimizer
state and are sent to rollout engines once, not after every step; a prefix that matches nothing is one line."""

import pytest
import torch
from safetensors.torch import load_file

from alignrl.models import lora
from alignrl.models.folder import ModelError
from alignrl.models.loader import frozen_copy
from alignrl.runner import train_grpo
from conftest import checkpoint_dir, recording_copy, run_settings, small_grpo

FROZEN = ("model.embed_tokens", "model.layers.0")


def test_frozen_prefixes_stay_bit_identical_through_training(tiny_model_dir, tmp_path):
    train_grpo(small_grpo(tiny_model_dir, *run_settings(tmp_path, "run", 2),
                          f"actor.freeze_prefix=[{','.join(FROZEN)}]"))
    base = load_file(tiny_model_dir / "model.safetensors")
    after = load_file(checkpoint_dir(tmp_path, "run", 2) / "model" / "model.safetensors")
    frozen = [k for k in base if k.startswith(FROZEN)]
    assert frozen and all(torch.equal(base[k], after[k]) for k in frozen)
    assert any(not torch.equal(base[k], after[k]) for k in base if not k.startswith(FROZEN))  # the rest trained


def test_frozen_parameters_have_no_optimizer_state_and_are_sent_once(tiny_model_dir, tmp_path):
    actor, copy, sink, sent = recording_copy(small_grpo(tiny_model_dir, "actor.freeze_prefix=[model.layers.0]"),
                                             tiny_model_dir)
    frozen = {id(p) for n, p in actor.model.named_parameters() if n.startswith("model.layers.0")}
    assert frozen and not any(id(p) in frozen for p in actor.engine.params)
    with torch.no_grad():  # as a step would: the trainable parameters move
        for p in actor.model.parameters():
            if p.requires_grad:
                p.add_(0.01)
    sink.publish(1)
    sink.publish(2)
    names = [n for n, _ in actor.model.named_parameters()]
    assert sent[0] == names  # the first publish: everything (the engine may hold another copy of the frozen part)
    assert sent[1] == [n for n in names if not n.startswith("model.layers.0")]
    for k, v in actor.model.state_dict().items():
        assert torch.equal(copy.state_dict()[k], v), k


def test_a_prefix_that_matches_nothing_is_one_line(tiny_model):
    model = tiny_model[0]
    with pytest.raises(ModelError) as e:
        lora.freeze_prefixes(frozen_copy(model), ["visual", "model.layers.0"])
    line = str(e.value)
    assert "'visual' matches no parameter" in line and "model.layers" in line and "\n" not in line


def test_visual_also_names_a_vision_tower_under_model():
    """transformers 5 moved a VLM's image tower to model.visual: LMM-R1's `--freeze_prefix visual` still means it."""
    net = torch.nn.Module()
    net.model = torch.nn.Module()
    net.model.visual = torch.nn.Linear(2, 2)
    net.model.language_model = torch.nn.Linear(2, 2)
    assert lora.freeze_prefixes(net, ["visual"]) == 2
    assert [n for n, p in net.named_parameters() if p.requires_grad] == ["model.language_model.weight",
                                                                         "model.language_model.bias"]
