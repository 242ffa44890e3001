"""The vLLM rollout engine of the Ray placement, on a machine without vLLM or GPUs: a stand-in `vllm`
module records how the engine is built, and the real weight broadcast (gloo) delivers the actor's
weights into it. What only a GPU machine with vLLM can show (generation, NCCL, vLLM's Ray executor
placing its tensor-parallel workers) is not tested here."""

import dataclasses
import json
import os
import sys
import threading
import types
from types import SimpleNamespace

import pytest
import torch

from alignrl.placements.ray.driver import Driver, Job
from alignrl.placements.ray.plan import GroupLayout
from alignrl.runtime.ports import free_port
from alignrl.placements.ray.weight_broadcast import BroadcastGroup
from alignrl.placements.ray.workers import EngineSpec, RolloutWorker
from alignrl.config import load_config, to_yaml
from alignrl.models.loader import load_model


class FakeLLM:
    """vllm.LLM as far as the engine and the weight sync use it: its arguments, and what the model's
    `load_weights` is given through `apply_model`."""

    def __init__(self, **kwargs):
        self.kwargs, self.loaded, self.cache_resets = kwargs, [], 0
        self.visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # what vLLM's engine process would see
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))

    def apply_model(self, fn):
        return [fn(SimpleNamespace(load_weights=lambda weights: self.loaded.extend(weights)))]

    def reset_prefix_cache(self):
        self.cache_resets += 1

    def generate(self, prompts, params, use_tqdm=True):
        """The seed of each prompt's params as its tokens (n samples each), so the test reads what vLLM got."""
        self.params = params
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[sp.seed % 97 + 1, j + 1], logprobs=None,
                                                         finish_reason="stop") for j in range(sp.n)])
                for _, sp in zip(prompts, params)]


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = FakeLLM, SimpleNamespace
    module.EngineArgs = dataclasses.make_dataclass("EngineArgs", [("model", str), ("logprobs_mode", str),
                                                                  ("mm_processor_kwargs", dict)])
    monkeypatch.setitem(sys.modules, "vllm", module)
    # a worker built outside Ray, as one without GPUs: ray.get_gpu_ids would otherwise start a local Ray instance in
    # the test's process (or join one that another test's `ray start` left on this machine)
    monkeypatch.setattr("ray.get_gpu_ids", lambda: [])
    # vllm_engine sets it in this process: set first, so that monkeypatch restores it (or its absence) after the
    # test; a bare delenv of an unset variable records nothing, and a later Ray cluster in this process saw GPU 5
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    return module


def test_a_vllm_engine_is_built_tensor_parallel_and_loads_the_broadcast_weights(fake_vllm, tiny_model_dir):
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "data.train_size=8", "trainer.device=cpu"])
    worker = RolloutWorker(to_yaml(cfg), 0, 0, 1, None, [], EngineSpec("vllm", 2, 0.5))
    llm = worker.engine.llm
    assert llm.kwargs["tensor_parallel_size"] == 2 and llm.kwargs["distributed_executor_backend"] == "ray"
    assert llm.visible is None  # vLLM's Ray executor places the tensor-parallel workers
    assert llm.kwargs["gpu_memory_utilization"] == 0.5 and llm.kwargs["model"] == str(tiny_model_dir)

    actor = [(n, p.detach() + 0.5) for n, p in load_model(str(tiny_model_dir))[0].named_parameters()]
    port = free_port()

    def send():  # actor rank 0's end of the weight group
        BroadcastGroup("127.0.0.1", port, 0, 2, "gloo", 30, torch.device("cpu")).send(actor, 3, 1 << 20)

    sender = threading.Thread(target=send)
    sender.start()
    worker.join("127.0.0.1", port, 2, "gloo", 30)
    assert worker.receive(1 << 20) == 3 and worker.version == 3
    sender.join(timeout=30)
    got = dict(llm.loaded)
    assert list(got) == [n for n, _ in actor] and llm.cache_resets == 1
    for name, value in actor:
        assert torch.equal(got[name], value), name


def test_a_one_gpu_vllm_engine_sees_only_the_gpu_ray_gave_its_worker(fake_vllm, monkeypatch, tiny_model_dir):
    # workers see all of their node's GPUs, and vLLM loads onto the first one it sees: every one-GPU engine
    # of a node went onto its GPU 0
    monkeypatch.setattr("ray.get_gpu_ids", lambda: [5])
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "data.train_size=8", "trainer.device=cpu"])
    llm = RolloutWorker(to_yaml(cfg), 3, 1, 1, None, [], EngineSpec("vllm", 1)).engine.llm
    assert llm.visible == "5" and "distributed_executor_backend" not in llm.kwargs


def test_vllm_log_probs_are_those_of_the_distribution_it_samples(fake_vllm, tiny_model_dir):
    from alignrl.interfaces import SamplingParams
    from alignrl.rollout.vllm_engine import EngineUnavailable, VLLMRolloutEngine

    engine = VLLMRolloutEngine(str(tiny_model_dir))
    assert engine.llm.kwargs["logprobs_mode"] == "processed_logprobs"  # after temperature, as the trainer's
    del fake_vllm.EngineArgs  # a vLLM before logprobs_mode: its log-probs are of the raw logits
    old = VLLMRolloutEngine(str(tiny_model_dir))
    assert "logprobs_mode" not in old.llm.kwargs
    with pytest.raises(EngineUnavailable, match="raw logits, which at temperature 0.7 .* install vllm 0.10.2"):
        old.generate([[1, 2]], SamplingParams(n=1, temperature=0.7, max_new_tokens=4))


def test_copies_of_a_prompt_get_seeds_of_their_own(fake_vllm, tiny_model_dir):
    """The multi-turn loop sends a GRPO group as n copies of its prompt with n=1: given one seed, vLLM's
    per-request generators drew the same tokens for every copy (a group of identical samples, advantage 0)."""
    from alignrl.interfaces import SamplingParams
    from alignrl.rollout.vllm_engine import VLLMRolloutEngine

    engine = VLLMRolloutEngine(str(tiny_model_dir))
    ro = engine.generate([[5, 6]] * 4, SamplingParams(n=1, max_new_tokens=4, seed=11))
    assert [sp.seed for sp in engine.llm.params] == [11, 12, 13, 14]
    assert len({tuple(r) for r in ro.response_ids.tolist()}) == 4


def test_the_engine_kind_is_vllm_only_on_gpus_with_vllm_and_engines_of_their_own(fake_vllm, monkeypatch,
                                                                                  tiny_model_dir):
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "trainer.device=cpu"])
    own = GroupLayout({"actor": (1, 2)}, engines=1, tp=2)
    colocated = GroupLayout({"actor": (1, 2)}, engines=1, tp=2, colocate_all_models=True)
    kinds = {}
    for cuda, vllm, layout in ((False, True, own), (True, True, own), (True, False, own), (True, True, colocated)):
        monkeypatch.setattr("importlib.util.find_spec", lambda name, vllm=vllm: object() if vllm else None)
        d = Driver(Job(layout, cfg, "test"))
        d.cuda = cuda
        kinds[(cuda, vllm, layout.colocate_all_models)] = d.engine_kind()
    assert kinds == {(False, True, False): "hf", (True, True, False): "vllm", (True, False, False): "hf",
                     (True, True, True): "hf"}


def test_a_vision_language_vllm_engine_takes_the_image_bounds_and_the_image_text_weights(fake_vllm, tmp_path):
    """A Qwen2-VL folder: the worker's parameter list (what the actor's weights are checked against and sent as) is
    the image-text model's, vision tower included (a causal-LM class cannot be built from its config), and vLLM
    resizes images within data.min_pixels/max_pixels as the trainer's processor does; a vLLM that cannot be told
    so is one line."""
    from alignrl.interfaces import SamplingParams
    from alignrl.models.tiny_vl import build_tiny_vl
    from alignrl.models.vision import processor_of
    from alignrl.rollout.vllm_engine import EngineUnavailable, VLLMRolloutEngine

    folder = build_tiny_vl(tmp_path / "tiny-vl", seed=0)
    bounds = ["data.min_pixels=784", "data.max_pixels=784"]
    cfg = load_config(None, [f"model.path={folder}", "data.train_size=8", "trainer.device=cpu", *bounds])
    worker = RolloutWorker(to_yaml(cfg), 0, 0, 1, None, [], EngineSpec("vllm", 1))
    assert worker.engine.llm.kwargs["mm_processor_kwargs"] == {"min_pixels": 784, "max_pixels": 784}
    worker.engine.generate([[5, 6]], SamplingParams(n=1, max_new_tokens=4, seed=1))  # responses never hold image
    vision = json.loads((folder / "config.json").read_text())  # placeholders, as the embedded engine bans them
    banned = {vision[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    assert worker.engine.llm.params[0].logit_bias == dict.fromkeys(sorted(banned), -100.0)
    assert processor_of(worker.tokenizer).image_processor.size["longest_edge"] == 784
    actor = load_model(str(folder))[0]
    assert [(n, p.shape) for n, p in worker.named] == [(n, p.shape) for n, p in actor.named_parameters()]
    assert any(n.startswith("model.visual.") for n, _ in worker.named)
    assert set(worker.engine.manifest()) == {n for n, _ in actor.named_parameters()}
    assert "mm_processor_kwargs" not in VLLMRolloutEngine(str(folder)).llm.kwargs  # the processor's own bounds
    fake_vllm.EngineArgs = dataclasses.make_dataclass("EngineArgs", [("model", str), ("logprobs_mode", str)])
    with pytest.raises(EngineUnavailable, match="takes no mm_processor_kwargs, so it would resize images"):
        VLLMRolloutEngine(str(folder), min_pixels=784, max_pixels=784)
