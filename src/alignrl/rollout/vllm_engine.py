"""vLLM behind the RolloutEngine interface: `generate(prompts, SamplingParams) -> Rollout`, `load_weights`.

A thin adapter for GPU machines (`alignrl serve generate --engine vllm`, the Ray rollout engines). vLLM
is imported only when an engine is built, and its absence is a one-line `EngineUnavailable` (a
UserError: the CLI prints it and exits 2). Log-probs are the sampled token's under the distribution
vLLM samples from (`logprobs_mode="processed_logprobs"`: after temperature), as the trainer computes them.
vLLM's default gives those of the raw logits, which at a temperature other than 1 are another policy's:
the rollout (old) log-probs and the rollout correction would compare the trainer with the wrong one. A vLLM
without `logprobs_mode` (before 0.10.2) can only sample at temperature 1 (or 0) here.
Weights are loaded through vLLM's own `model.load_weights`, which takes Hugging Face parameter names.
Prompts with images (`data.images.ImagePrompt`) go to vLLM with their Pillow images as `multi_modal_data`; their
ids already hold the expanded image tokens, which vLLM's Qwen2-VL processing recognises as such. Behind
`alignrl serve generate --engine vllm` the pictures come as PNG in the request (`serve.request_images`).
Deliberately left out: LoRA adapters, videos, vLLM's async engine.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch

from alignrl.data.records import Rollout
from alignrl.errors import UserError
from alignrl.interfaces import SamplingParams
from alignrl.rollout.remote import rollout_from_rows


def request(prompt: Sequence[int]) -> dict:
    """vLLM's prompt for `prompt`: its token ids, and a prompt with images (an ImagePrompt) its Pillow images, which
    vLLM processes itself (pixel rows alone, without the pictures, it cannot read)."""
    out = {"prompt_token_ids": list(prompt)}
    pictures = getattr(prompt, "pictures", ())
    if getattr(prompt, "images", None) is not None and not pictures:
        raise EngineUnavailable("a prompt's images came as pixel rows without their pictures, which vLLM needs: "
                                "generate prompts with images with the embedded engine (--engine hf)")
    if pictures:
        out["multi_modal_data"] = {"image": list(pictures)}
    return out


class EngineUnavailable(UserError):
    """The requested engine cannot run here; the message says what to install or use instead."""


def import_vllm():
    try:
        import vllm
    except ImportError:
        raise EngineUnavailable("vllm is not installed; install it on a GPU machine or use --engine hf") from None
    return vllm


def _engine_args(vllm) -> set[str]:
    """The names vLLM's engine (and so `LLM(...)`) takes; empty for a vLLM without EngineArgs fields."""
    import dataclasses

    args = getattr(vllm, "EngineArgs", None)
    return {f.name for f in dataclasses.fields(args)} if dataclasses.is_dataclass(args) else set()


class VLLMRolloutEngine:
    needs_pictures = True  # reads a prompt's images as Pillow pictures (`request`), not as pixel rows

    def __init__(self, path: str, tensor_parallel_size: int = 1, dtype: str = "auto",
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.85,
                 distributed_executor_backend: str | None = None, min_pixels: int = 0, max_pixels: int = 0):
        """`min_pixels`/`max_pixels` (data.min_pixels/max_pixels, 0: the processor's own bounds): a vision-language
        model's images are resized within them by vLLM's processor as by the trainer's, so both count the same image
        tokens in a prompt."""
        self.vllm = import_vllm()
        from transformers import AutoConfig, AutoTokenizer

        from alignrl.models.vision import config_vision_token_ids, is_vision_folder, load_processor

        self.path = path
        self.config = AutoConfig.from_pretrained(path)
        # a response holding an image placeholder breaks the trainer's next forward (the embedded engine bans them too);
        # vLLM clamps a logit bias to -100, which leaves them a probability of about e^-100 of the top token's
        banned = config_vision_token_ids(self.config)
        self.banned = {"logit_bias": dict.fromkeys(banned, -100.0)} if banned else {}

        # a vision-language model's tokenizer carries its processor: chat requests with images are templated by it
        vision = is_vision_folder(path)
        self.tokenizer = (load_processor(path, min_pixels, max_pixels).tokenizer if vision else
                          AutoTokenizer.from_pretrained(path))
        self.pad_id = (self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
                       else self.tokenizer.eos_token_id)
        # float32 is the CPU default of `alignrl serve`; on a GPU the checkpoint's own dtype ("auto") is the sane one.
        # inside a Ray actor, tensor parallelism runs on vLLM's Ray executor: its workers take the GPUs of
        # the placement group the actor was started in ("ray"); None leaves vLLM its own choice
        extra = {"distributed_executor_backend": distributed_executor_backend} if distributed_executor_backend else {}
        # load_weights hands vLLM a function (apply_model), which its V1 engine runs in its own engine-core
        # process: vLLM refuses to serialize one unless this is set (a child of this process, not a peer)
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        self.scaled_logprobs = "logprobs_mode" in _engine_args(self.vllm)
        if self.scaled_logprobs:
            extra["logprobs_mode"] = "processed_logprobs"
        bounds = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v}
        if vision and bounds:  # vLLM processes the Pillow images again, with these kwargs to the HF processor
            if "mm_processor_kwargs" not in _engine_args(self.vllm):
                raise EngineUnavailable(f"vllm {getattr(self.vllm, '__version__', '?')} takes no mm_processor_kwargs, "
                                        "so it would resize images otherwise than data.min_pixels/max_pixels say: "
                                        "install a newer vllm, or leave both at 0")
            extra["mm_processor_kwargs"] = bounds
        self.llm = self.vllm.LLM(model=path, tensor_parallel_size=tensor_parallel_size,
                                 dtype="auto" if dtype == "float32" else dtype, max_model_len=max_model_len,
                                 gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=True, **extra)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Rollout:
        if not self.scaled_logprobs and params.temperature not in (0.0, 1.0):
            raise EngineUnavailable(
                f"vllm {getattr(self.vllm, '__version__', '?')} returns log-probs of the raw logits, which at "
                f"temperature {params.temperature} are not those of the policy it samples: install vllm 0.10.2 or "
                "later (logprobs_mode), or sample at temperature 1")
        # one seed per prompt: vLLM seeds each request's own generator, so copies of a prompt given one seed
        # (the multi-turn loop sends a GRPO group as n copies) would all sample the same tokens
        sps = [self.vllm.SamplingParams(n=params.n, temperature=params.temperature, top_p=params.top_p,
                                        top_k=params.top_k if params.top_k > 0 else -1, min_p=params.min_p,
                                        repetition_penalty=params.repetition_penalty,
                                        max_tokens=params.max_new_tokens, stop=list(params.stop) or None,
                                        include_stop_str_in_output=True, logprobs=0,
                                        seed=None if params.seed is None else params.seed + i, **self.banned)
               for i in range(len(prompts))]
        outs = self.llm.generate([request(p) for p in prompts], sps, use_tqdm=False)
        rows = []
        for out in outs:  # vLLM keeps the input order; its n samples per prompt are contiguous
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = [c.logprobs[t][tok].logprob for t, tok in enumerate(ids)] if c.logprobs else [0.0] * len(ids)
                rows.append((ids, lps, c.finish_reason == "length"))
        return rollout_from_rows(prompts, params.n, rows, self.pad_id)  # with the prompts' images

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # host tensors: the function travels to vLLM's engine process, which sees only its own GPU (as its
        # device 0), so a tensor on this process's cuda:k could not be rebuilt there
        weights = [(n, t.cpu()) for n, t in named_tensors]
        self.llm.apply_model(lambda model: model.load_weights(weights=weights))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def manifest(self) -> dict:
        """Names, shapes, dtypes a trainer must push: those of the HF model, built without memory."""
        from alignrl.models.loader import meta_model
        from alignrl.wire.http_weights import manifest_of

        return manifest_of(meta_model(self.path, self.llm.llm_engine.model_config.dtype).named_parameters())
