"""The vision demo's task: count the squares of one colour in a small picture.

A picture is 56x56 pixels, a 4x4 grid of 14-pixel cells (one cell a vision patch of the tiny Qwen2-VL model), each
cell empty or holding a red, blue or green square; the question names one colour and the answer is how many squares
have it (0..8). Rows are written in LMM-R1's chatml layout, the one seed 001's vision script trains on: `message` is
a JSON string of an OpenAI-style message list whose user turn holds the image as `{"type": "image", "image":
"file:///..."}` and the question as text, `answer` the count, `data_source` the R1 rule reward (`think_answer`).
Everything follows from the seed: the same seed gives the same pictures and rows.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from alignrl.rewards.think_answer import DATA_SOURCE

SIZE, CELL, GRID = 56, 14, 4  # pixels, pixels per cell, cells per side
COLOURS = {"red": (220, 40, 40), "blue": (40, 70, 220), "green": (40, 160, 60)}
ASKED = ("red",)  # the colours questions ask about (the others are distractors)
BACKGROUND = (255, 255, 255)
FILL = 0.45  # chance that a cell holds a square; its colour is then one of COLOURS
MAX_COUNT = 8  # pictures with more squares of the asked colour are drawn again: answers 0..MAX_COUNT
THINK = "I count the {colour} squares."


@dataclass(frozen=True)
class Picture:
    cells: tuple[str | None, ...]  # GRID*GRID cells, row by row: a colour name or None
    colour: str  # the colour the question asks about

    @property
    def count(self) -> int:
        return sum(c == self.colour for c in self.cells)

    def question(self) -> str:
        return (f"How many {self.colour} squares are in the picture? Think in <think></think>, then give the "
                "number in <answer></answer>.")


def response(colour: str, count: int) -> str:
    """The answer in the R1 form the reward checks."""
    return f"<think>{THINK.format(colour=colour)}</think><answer>{count}</answer>"


def draw(p: Picture):
    """The picture as a Pillow image: a filled square inset one pixel in each non-empty cell."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    pen = ImageDraw.Draw(img)
    for i, colour in enumerate(p.cells):
        if colour is not None:
            x, y = (i % GRID) * CELL, (i // GRID) * CELL
            pen.rectangle([x + 1, y + 1, x + CELL - 2, y + CELL - 2], fill=COLOURS[colour])
    return img


def pictures(n: int, seed: int) -> list[Picture]:
    rng = random.Random(seed)
    names = sorted(COLOURS)
    out: list[Picture] = []
    while len(out) < n:
        cells = tuple(rng.choice(names) if rng.random() < FILL else None for _ in range(GRID * GRID))
        p = Picture(cells, rng.choice(ASKED))
        if p.count <= MAX_COUNT:
            out.append(p)
    return out


def messages(image: str | None, p: Picture) -> list[dict]:
    """The prompt: one user turn, the image first, then the question (`image`: its file, None for the bare item)."""
    item = {"type": "image", "image": f"file://{image}"} if image else {"type": "image"}
    return [{"role": "user", "content": [item, {"type": "text", "text": p.question()}]}]


def write_split(folder: Path, split: str, n: int, seed: int) -> Path:
    """`folder/<split>.jsonl` (rows in LMM-R1's chatml layout) and its pictures under `folder/images/`."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, p in enumerate(pictures(n, seed)):
        path = (folder / "images" / f"{split}_{i:05d}.png").resolve()
        draw(p).save(path)
        rows.append({"message": json.dumps(messages(str(path), p)), "answer": str(p.count),
                     "data_source": DATA_SOURCE})
    out = folder / f"{split}.jsonl"
    tmp = out.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(out)
    return out


# train, held-out and SFT pictures come from seeds apart, so no held-out picture is trained on by chance of seeds
SPLIT_SEEDS = {"train": 1, "test": 2, "sft": 3}


def write_data(folder: Path, seed: int, n_train: int, n_test: int) -> dict[str, Path]:
    return {split: write_split(folder, split, n, seed * 1000 + SPLIT_SEEDS[split])
            for split, n in (("train", n_train), ("test", n_test))}


def sft_pictures(n: int, seed: int) -> list[Picture]:
    return pictures(n, seed * 1000 + SPLIT_SEEDS["sft"])


def tokenizer_texts() -> list[str]:
    """What the tiny model's tokenizer is trained on: every question and answer form."""
    return [p + " " + response(c, k) for c in ASKED for k in range(MAX_COUNT + 1)
            for p in [Picture((), c).question()]] * 20
