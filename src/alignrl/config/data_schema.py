"""The config section of the task data: the files (or synthetic problems), their layout and columns, the prompts'
length and templating, and images (docs/data.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from alignrl.config.option import opt


@dataclass(frozen=True)
class DataConfig:
    # str or list: verl's `data.train_files=[a.parquet,b.parquet]` gives a list (checked in checks.py)
    train_files: Any = opt("synthetic", "'synthetic' (built-in arithmetic problems), a .jsonl/.json/.parquet file, "
                                        "or a list of them ([a.parquet,b.parquet], concatenated)")
    train_files_probs: list = opt([], "with a list of data.train_files: each file's share of the training rows, one "
                                      "weight per file ([0.7,0.3]; OpenRLHF's --prompt_data_probs): rows are drawn "
                                      "by weight, seeded by trainer.seed, until every file was used once (a file "
                                      "that runs out first starts over); [] concatenates the files")
    val_files: Any = opt("synthetic", "held-out data: 'synthetic', a .jsonl/.json/.parquet file, or a list of them")
    format: str = opt("auto", "file layout", choices=("auto", "gsm8k", "verl"))
    dataset_class: str = opt("", "path/to/file.py:Class, a verl dataset class (RLHFDataset subclass; verl's "
                                 "data.custom_cls) that makes the rows of the data files (docs/data.md)")
    train_size: int = opt(20000, "number of synthetic training problems (ignored for files)", ge=1)
    train_max_samples: int = opt(-1, "files: train on the first N rows of data.train_files only (OpenRLHF's "
                                     "--max_samples; with data.train_files_probs, the first N of each file, then of "
                                     "the blend); -1 or 0: every row", ge=-1)
    val_size: int = opt(1000, "held-out problems for the final evaluation (files: at most this many)", ge=1)
    val_size_during_training: int = opt(256, "held-out problems evaluated every trainer.test_freq steps", ge=1)
    train_batch_size: int = opt(32, "prompts per RL step (verl's data.train_batch_size)", ge=1)
    gen_batch_size: int = opt(0, "with algorithm.dynamic_sampling: prompts drawn per generation round, of which the "
                                 "first data.train_batch_size groups kept are trained (verl's data.gen_batch_size, "
                                 "DAPO's gen_prompt_bsz); 0: data.train_batch_size", ge=0)
    max_prompt_length: int = opt(128, "prompt tokens kept (truncated from the left)", ge=8)
    truncation: str = opt("left", "a prompt over data.max_prompt_length: left keeps its last tokens (the generation "
                                  "prompt); right its first; middle its first and last halves; error stops the run "
                                  "naming the row (verl's data.truncation). Image tokens are never cut: a prompt with "
                                  "images loses its earliest text", choices=("left", "right", "middle", "error"))
    filter_overlong_prompts: bool = opt(False, "drop prompts over data.max_prompt_length at load, counted (verl's)")
    max_start_length: int = opt(0, "multi-turn: tokens of the initial prompt kept (from the left); 0 uses "
                                   "data.max_prompt_length (Search-R1's data.max_start_length)", ge=0)
    max_obs_length: int = opt(500, "multi-turn: tokens of one tool observation kept; longer ones are truncated "
                                   "(Search-R1's data.max_obs_length)", ge=1)
    prompt_key: str | None = opt(None, "prompt column (verl's data.prompt_key, OpenRLHF's --input_key): a string or "
                                       "a list of {role, content} messages; unset: the GSM8K/verl layout is "
                                       "detected from the columns")
    label_key: str | None = opt(None, "with data.prompt_key: the answer column the rule reward compares with "
                                      "(OpenRLHF's --label_key); unset: verl's reward_model.ground_truth when the "
                                      "row has one, else no answer (the reward comes from a reward model)")
    input_template: str | None = opt(None, "with data.prompt_key and data.apply_chat_template=false: the prompt is "
                                           "this text with {} for the column: 'User: {}\\nAssistant: ' (OpenRLHF's)")
    apply_chat_template: bool = opt(True, "prompts go through the tokenizer's chat template; false (with "
                                          "data.prompt_key) tokenizes the string prompt as it is, or through "
                                          "data.input_template (OpenRLHF's --apply_chat_template)")
    system_prompt: str | None = opt(None, "system message prepended to every prompt")
    chat_template_kwargs: dict[str, Any] = opt({}, "extra variables of the chat template wherever a prompt, a tool "
                                                   "turn or a held-out prompt is templated, e.g. {enable_thinking: "
                                                   "false} for Qwen3 (verl's data.apply_chat_template_kwargs)")
    image_key: str = opt("images", "multimodal rows: the column of image paths or bytes (verl's data.image_key, "
                                   "TRL's images); images inside chat messages need none")
    min_pixels: int = opt(0, "multimodal: images smaller than this many pixels are upscaled; 0: the processor's own",
                          ge=0)
    max_pixels: int = opt(0, "multimodal: images larger than this many pixels are downscaled (fewer image tokens); "
                             "0: the processor's own", ge=0)
    shuffle: bool = opt(True, "reshuffle the training data every epoch")

    @property
    def draw_size(self) -> int:
        """Prompts drawn from the training data per generation round (a step's first, and dynamic sampling's
        extra ones)."""
        return self.gen_batch_size or self.train_batch_size

    @property
    def train_row_cap(self) -> int | None:
        """The rows read from data.train_files: its first train_max_samples, or every row (None)."""
        return self.train_max_samples if self.train_max_samples > 0 else None
