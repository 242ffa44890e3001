"""Value models: an LM backbone with a scalar head per token, in HF token-classification form.

As in verl's critic, the value model is `AutoModelForTokenClassification` with `num_labels=1`, so it
saves and loads as a plain HF folder; initialised from a causal-LM folder, the backbone weights are
copied and the head starts from a seeded small random init. A vision-language folder loads the same way
through the class `models.vision_value` registers, and reads the prompts' images.
"""

from __future__ import annotations

import torch

from alignrl.data.collate import position_ids
from alignrl.models.logprobs import model_device
from alignrl.models.loader import DTYPES, ModelError, disable_dropout, loading, resolve_model_path
from alignrl.models.packing import pack, packed_forward, unpack
from alignrl.models.quantized import FourBit, load_4bit, prepare_for_adapters, require_bitsandbytes
from alignrl.models.vision import encoder_in_every_forward, is_vision_folder, is_vision_model, vision_inputs


def load_value_model(path: str, dtype: str = "float32", seed: int = 0, log=print, four_bit: FourBit | None = None,
                     device: torch.device | None = None):
    """The value model of `path` in `dtype`; with `four_bit` (QLoRA's critic, as OpenRLHF quantizes it) its linear
    layers quantized on `device` as they load, the value head not, every weight frozen for the adapters."""
    from transformers import AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    folder = resolve_model_path(path, log)
    if is_vision_folder(folder):  # transformers has no token-classification class for image-text models
        if four_bit is not None:
            raise ModelError(f"critic: {folder} is a vision-language model, which alignrl loads unquantized; set "
                             "model.load_in_4bit=false")
        from alignrl.models.vision_value import register

        register()
    if four_bit is not None:
        require_bitsandbytes()
    torch.manual_seed(seed)  # the head of a policy-initialised critic is new: make it reproducible
    hf_logging.disable_progress_bar()  # as for the policy: a critic rank's loads and saves drew bars in its log
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "newly initialized score weights" is expected here, not a problem
    kw = dict(num_labels=1, key_mapping=HEAD_NAMES)
    try:
        with loading(folder, "value model"):
            model = (AutoModelForTokenClassification.from_pretrained(str(folder), dtype=DTYPES[dtype], **kw)
                     if four_bit is None else
                     prepare_for_adapters(load_4bit(folder, DTYPES[dtype], four_bit, device,
                                                    AutoModelForTokenClassification, VALUE_HEADS, **kw)))
            saved_as_transformers_names(model)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.config.use_cache = False
    # no dropout in a value model (TRL and OpenRLHF turn it off too): the token-classification head comes
    # with p=0.1, which made values noisy in training mode and made data-parallel ranks draw other masks
    # than one process does, so a DDP critic did not train as a single one
    model.config.classifier_dropout = 0.0
    disable_dropout(model)
    return model


def response_values(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                    response_mask: torch.Tensor, remove_padding: bool = False, images=None) -> torch.Tensor:
    """Values (B, R): V_t is read at the position before response token t (the state it is chosen in),
    the same alignment as the log-probs. `remove_padding`: one packed row, no padding (models.packing).
    `images`: the rows' prompt images (`data.images.ImageRows`), for a vision-language value model
    (`models.vision_value`), which takes the plain forward (packing is skipped for them)."""
    with_images = images is not None and images.any()
    if with_images and not is_vision_model(model):
        raise ModelError("PPO's critic is a text-only model but the prompts carry images: set critic.model_path to "
                         "a vision-language model (unset, the critic starts from the policy's folder)")
    dev = model_device(model)
    with encoder_in_every_forward(model, images):  # the forward below, whichever layout
        if remove_padding and not with_images:  # rows with images take the plain forward (as in response_logprobs)
            packing = pack(*(t.to(dev) for t in (prompt_ids, prompt_mask, response_ids, response_mask)))
            return unpack(packed_forward(model, packing).logits[0, packing.keep, 0].float(), packing)
        ids = torch.cat([prompt_ids, response_ids], 1).to(dev)
        mask = torch.cat([prompt_mask, response_mask], 1).to(dev)
        r = response_ids.shape[1]
        vision = vision_inputs(model, ids, mask, images)  # {} without images
        vision.setdefault("position_ids", position_ids(mask))
        out = model(input_ids=ids, attention_mask=mask.long(), **vision)
    return out.logits[:, -r - 1:-1, 0].float() * response_mask.to(dev)


# OpenRLHF's reward model class saves under this architecture name (its critic under CriticModel), with the backbone
# under the base model's prefix as transformers keeps it and the head as `value_head` (its older default) or `score`
OPENRLHF_REWARD_CLASS = "RewardModel"
# the heads of transformers' token classifiers (Llama's and Qwen's `score`, BERT-like models' `classifier`)
VALUE_HEADS = ("score", "classifier")
HEAD_NAMES = {r"^value_head\.": "score."}  # loads either as the `score` head of transformers' classification models


def saved_as_transformers_names(model) -> None:
    """transformers reverses the renamings of a load when the model is saved: the head of an OpenRLHF folder, loaded as
    `score`, would go back to disk as `value_head` under a transformers architecture, which no other loader reads.
    Forgetting that one renaming (the model's own conversions stay) saves it as `score`."""
    done = getattr(model, "_weight_conversions", None)
    if done:
        model._weight_conversions = [c for c in done if list(getattr(c, "source_patterns", ())) != list(HEAD_NAMES)]


def not_a_scorer(path: str, why: str) -> ModelError:
    return ModelError(f"{path} is not a reward/cost model: it has no scoring head ({why}); train one with "
                      "`alignrl train rm`, or save a sequence-classification model")


def check_scorer_folder(path: str, key: str) -> None:
    """What ModelScorer would find, read from the folder's config.json alone (no weights loaded): a folder at all
    (the error names `key`, the setting that gave it), and a scoring head, which a causal LM's architecture lacks.
    Checked before the policy loads, or any Ray worker starts."""
    import json

    config = json.loads((resolve_model_path(path, lambda *_: None, key) / "config.json").read_text())
    arch = config.get("architectures") or []
    # OpenRLHF's critic is a value model, not a scorer: only its reward model class scores
    if arch and not any(a.endswith("ForSequenceClassification") or a == OPENRLHF_REWARD_CLASS for a in arch):
        raise not_a_scorer(path, f"its architecture is {arch[0]}")


def score_normalization(config, path: str, log, what: str = "reward model") -> tuple[float, float]:
    """(mean, std) of a reward model's config.json, which normalize its scores (and, with `what`="critic", the values
    of a critic initialised from it, as OpenRLHF's critic does); (0, 1), said once, when it holds none (OpenRLHF
    falls back the same way) or a std that is not positive."""
    mean, std = getattr(config, "mean", None), getattr(config, "std", None)
    outputs = "values" if what == "critic" else "scores"
    if isinstance(mean, (int, float)) and isinstance(std, (int, float)) and std > 0:
        log(f"{what} {path}: {outputs} normalized as ({outputs[:-1]} - {mean:.4g}) / {std:.4g} (its config.json)")
        return float(mean), float(std)
    log(f"{what} {path}: its config.json holds no mean and std to normalize by: {outputs} used as they are "
        "(`alignrl train rm` writes them)")
    return 0.0, 1.0


class ModelScorer:
    """A sequence-level scorer (reward or cost model: an HF sequence-classification folder with one
    label) applied to rollouts; the score is read at each sequence's last real token."""

    def __init__(self, path: str, dtype: str = "float32", log=print, device: str | torch.device = "cpu",
                 normalize: bool = False):
        """`normalize`: scores as (score - mean) / std with the mean and std of the folder's config.json (a folder
        without them scores as it is, and says so)."""
        from transformers import AutoModelForSequenceClassification

        folder = resolve_model_path(path, log)
        self.name = path  # how score errors name it
        from transformers.utils import logging as hf_logging

        with loading(folder, "reward/cost model"):
            quiet = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # its load report of a missing head: said below in one line
            try:
                model, info = AutoModelForSequenceClassification.from_pretrained(
                    str(folder), num_labels=1, dtype=DTYPES[dtype], output_loading_info=True, key_mapping=HEAD_NAMES)
            finally:
                hf_logging.set_verbosity(quiet)
        # a causal LM folder loads too, with a freshly drawn (random) head: scores that mean nothing
        head = [k for k in info["missing_keys"] if not k.startswith(model.base_model_prefix + ".")]
        if head:
            raise not_a_scorer(path, f"its weights lack {head[0]}")
        self.model = model.to(device)
        self.model.eval()
        self.shift, self.scale = 0.0, 1.0
        if normalize:
            self.shift, self.scale = score_normalization(model.config, path, log)

    @torch.no_grad()
    def score(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
              response_mask: torch.Tensor) -> torch.Tensor:
        """Scores (B,) of each (prompt, response)."""
        dev = model_device(self.model)
        ids = torch.cat([prompt_ids, response_ids], 1).to(dev)
        mask = torch.cat([prompt_mask, response_mask], 1).to(dev)
        backbone = getattr(self.model, self.model.base_model_prefix)
        hidden = backbone(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids(mask)).last_hidden_state
        last = mask.shape[1] - 1 - mask.long().flip(-1).argmax(-1)  # index of each row's last real token
        scores = self.model.score(hidden[torch.arange(ids.shape[0], device=dev), last]).squeeze(-1).float().cpu()
        return (scores - self.shift) / self.scale
