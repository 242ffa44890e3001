"""The prompt rows every producer shares: the task's train and held-out samples as a run config names them (a
file's rows, or seeded synthetic arithmetic), and their prompt token ids, templated on first use."""

from __future__ import annotations

from alignrl.config import RunConfig
from alignrl.data import synthetic
from alignrl.data.collate import encode_prompts, prompt_ids
from alignrl.data.images import PROCESSOR_ATTR, ImageDataError, prompt_length, set_pixel_bounds
from alignrl.data.loaders import DataError, dataset_class_samples, load_blended, load_samples
from alignrl.rewards.registry import ground_truth_problem
from alignrl.utils.tracking import console


def load_task_data(cfg: RunConfig, tokenizer=None, tools: list[dict] | None = None):
    """The training and held-out samples. With data.filter_overlong_prompts and the policy's `tokenizer`, prompts
    longer than data.max_prompt_length are dropped from both (counted), measured with `tools` (verl's tool schemas,
    templated into the prompt as the episodes read it); without a tokenizer (a check before any model loads) every
    row is kept. Given a vision-language model's tokenizer, its processor resizes images within
    data.min_pixels..max_pixels; given a text-only model's, rows with images are refused."""
    d = cfg.data
    # a file's columns: detected (GSM8K/verl), or named by data.prompt_key/label_key (both splits alike)
    if d.input_template and "\\n" in d.input_template and "\n" not in d.input_template:  # OpenRLHF warns too
        console.print("data.input_template holds the two characters \\n, not a newline: in bash pass "
                      "$'...\\n...', or write the template in double quotes in the YAML file", markup=False)
    keys = dict(system_prompt=d.system_prompt, prompt_key=d.prompt_key, label_key=d.label_key,
                input_template=d.input_template, apply_chat_template=d.apply_chat_template, image_key=d.image_key)
    train = (synthetic.generate("train", d.train_size, seed=cfg.trainer.seed, system_prompt=d.system_prompt)
             if d.train_files == "synthetic" else
             dataset_class_samples(d, d.train_files, d.train_row_cap, "data.train_files") if d.dataset_class else
             load_blended(d.train_files, d.train_files_probs, cfg.trainer.seed, d.format, limit=d.train_row_cap,
                          **keys) if d.train_files_probs else
             load_samples(d.train_files, d.format, limit=d.train_row_cap, **keys))
    val = (synthetic.generate("test", d.val_size, seed=cfg.trainer.seed, system_prompt=d.system_prompt)
           if d.val_files == "synthetic" else
           dataset_class_samples(d, d.val_files, d.val_size, "data.val_files") if d.dataset_class else
           load_samples(d.val_files, d.format, limit=d.val_size, key="data.val_files", **keys))
    if cfg.algorithm.reward_fn is None:  # a user's function decides what its ground truth looks like
        for s in (*train, *val):
            problem = ground_truth_problem(s.data_source, s.ground_truth)
            if problem:
                raise DataError(f"{s.source or 'a row'}: {problem}")
    if tokenizer is not None and getattr(tokenizer, PROCESSOR_ATTR, None) is not None:
        set_pixel_bounds(getattr(tokenizer, PROCESSOR_ATTR), d.min_pixels, d.max_pixels)
    elif tokenizer is not None:
        with_images = next((s for s in (*train, *val) if s.images), None)
        if with_images is not None:
            raise ImageDataError(f"{with_images.source or 'a row'}: its prompt has images but model.path is a text-only "
                                 "model; use a vision-language model (e.g. Qwen2-VL) or data without images")
    if d.filter_overlong_prompts and tokenizer is not None:
        train, val = (drop_overlong(rows, tokenizer, d.max_prompt_length, what, tools) for rows, what in
                      ((train, "training"), (val, "held-out")))
    return train, val


def drop_overlong(samples: list, tokenizer, max_len: int, what: str, tools: list[dict] | None = None) -> list:
    """`samples` without those whose whole prompt, with `tools`' schemas where given, is longer than `max_len` tokens
    (verl's filter_overlong_prompts, which templates its tool config's schemas in too)."""
    def length(s) -> int:  # a prompt with images counts its image tokens (data.images)
        return prompt_length(tokenizer, s) if s.images else len(prompt_ids(tokenizer, s, tools))

    kept = [s for s in samples if length(s) <= max_len]
    if len(kept) < len(samples):
        console.print(f"data.filter_overlong_prompts: dropped {len(samples) - len(kept)} of {len(samples)} {what} "
                      f"prompts longer than data.max_prompt_length={max_len} tokens", markup=False)
    if samples and not kept:
        raise DataError(f"every {what} prompt is longer than data.max_prompt_length={max_len} tokens: raise it, or "
                        "set data.filter_overlong_prompts=false to keep their last tokens")
    return kept


class PromptData:
    """Dataset rows -> (samples, prompt ids), the ids templated on first use: templating a large dataset up
    front costs seconds. `tools`: verl's tool schemas, templated into each prompt before it is cut."""

    def __init__(self, tokenizer, samples, max_len: int, truncation: str = "left", tools: list[dict] | None = None):
        self.tokenizer, self.samples, self.max_len, self.cache = tokenizer, samples, max_len, {}
        self.truncation = truncation  # data.truncation: left, right, middle, or error (stops the run, named)
        self.tools = tools

    def prompt(self, i: int) -> list[int]:
        if i not in self.cache:
            self.cache[i] = encode_prompts(self.tokenizer, [self.samples[i]], self.max_len, self.truncation,
                                           self.tools)[0]
        return self.cache[i]

    def __call__(self, index) -> tuple[list, list[list[int]]]:
        return [self.samples[i] for i in index], [self.prompt(i) for i in index]
