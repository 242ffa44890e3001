"""A value model for vision-language (Qwen2-VL) policies: the image-text backbone with a scalar head per token.

transformers has a token-classification class (what `models.value` loads a critic as) for text decoders but none
for image-text models, so PPO's critic could not read prompts with images. `register` adds one for the Qwen2-VL
config under `AutoModelForTokenClassification`: from the policy's folder it copies the backbone (vision tower
included) and draws a new head, as a text critic does; it saves as a plain folder (architecture
`Qwen2VLForTokenClassification`) and loads back through the same Auto class. verl builds its vision critic the same
way in substance (TRL's value-head wrapper around the image-text model).
"""

from __future__ import annotations

import functools


@functools.cache
def value_model_class():
    """The class, built on first use: importing transformers' Qwen2-VL modelling is slow."""
    from torch import nn
    from transformers.modeling_outputs import TokenClassifierOutput
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel, Qwen2VLPreTrainedModel

    class Qwen2VLForTokenClassification(Qwen2VLPreTrainedModel):
        """Qwen2-VL's backbone (`model`, the same weight names as the image-text-to-text class) and a linear head
        (`score`, as in transformers' text token-classification classes) over every position's last hidden state."""

        def __init__(self, config):
            super().__init__(config)
            self.num_labels = config.num_labels
            self.model = Qwen2VLModel(config)
            self.score = nn.Linear(config.get_text_config().hidden_size, config.num_labels)
            self.post_init()

        def get_input_embeddings(self):
            return self.model.get_input_embeddings()

        def set_input_embeddings(self, value):
            self.model.set_input_embeddings(value)

        def forward(self, input_ids=None, attention_mask=None, position_ids=None, pixel_values=None,
                    image_grid_thw=None, inputs_embeds=None, **kwargs) -> TokenClassifierOutput:
            kwargs.pop("use_cache", None)  # a value model keeps no cache
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             pixel_values=pixel_values, image_grid_thw=image_grid_thw, inputs_embeds=inputs_embeds,
                             use_cache=False, **kwargs)
            return TokenClassifierOutput(logits=self.score(out.last_hidden_state))

    return Qwen2VLForTokenClassification


def register() -> None:
    """Makes `AutoModelForTokenClassification` load Qwen2-VL folders (idempotent). The class reads weight names as
    the image-text-to-text class does (transformers renames a checkpoint's older layouts by class name)."""
    from transformers import AutoModelForTokenClassification, Qwen2VLConfig
    from transformers.conversion_mapping import (get_checkpoint_conversion_mapping,
                                                 register_checkpoint_conversion_mapping)

    cls = value_model_class()
    renames = get_checkpoint_conversion_mapping("Qwen2VLForConditionalGeneration")
    if renames:
        register_checkpoint_conversion_mapping(cls.__name__, renames, overwrite=True)
    AutoModelForTokenClassification.register(Qwen2VLConfig, cls, exist_ok=True)
