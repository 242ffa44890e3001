"""What the vision tests share: four one-colour pictures, LMM-R1 rows that name them, those rows as a data file, and
a reward that varies between the samples of an untrained model."""

import json
from pathlib import Path

from PIL import Image

COLORS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0)}

# a reward that differs between samples of a random model, so advantages (and updates) are non-zero
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 3) / 2.0
'''


def save_pictures(folder: Path) -> dict[str, Path]:
    """One 56 x 56 PNG per colour of COLORS in `folder`, by colour name."""
    out = {}
    for name, rgb in COLORS.items():
        Image.new("RGB", (56, 56), rgb).save(folder / f"{name}.png")
        out[name] = folder / f"{name}.png"
    return out


def lmm_r1_row(image: Path, text: str, answer: str = "5") -> dict:
    """LMM-R1's row: `message` a JSON string of chat messages whose content items name their images."""
    content = [{"type": "image", "image": f"file://{image}"}, {"type": "text", "text": text}]
    return {"message": json.dumps([{"role": "user", "content": content}]), "answer": answer}


def color_rows(pictures: dict[str, Path]) -> list[dict]:
    """One LMM-R1 row per picture, asking its colour; the answer is the colour's name."""
    return [lmm_r1_row(pictures[c], f"Which color is picture {i}?", c) for i, c in enumerate(COLORS)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def image_tokens(tokenizer, ids) -> int:
    """How many image placeholder tokens `ids` holds."""
    return sum(t == tokenizer.convert_tokens_to_ids("<|image_pad|>") for t in ids)


def vl_rollout(vl, pictures, tmp_path, n=3):
    """A rollout of the tiny VL model (`vl`: model, tokenizer) over two picture prompts and one text prompt."""
    from alignrl.data.collate import encode_prompts
    from alignrl.data.loaders import load_samples
    from alignrl.data.synthetic import generate
    from alignrl.interfaces import SamplingParams
    from alignrl.rollout.hf_engine import HFRolloutEngine

    model, tok = vl
    rows = [lmm_r1_row(pictures["red"], "What is 2+3?"), lmm_r1_row(pictures["blue"], "Which color is this?")]
    samples = load_samples(str(write_jsonl(tmp_path / "r.jsonl", rows)), prompt_key="message", label_key="answer")
    prompts = encode_prompts(tok, samples + generate("train", 1, seed=0), 96)  # a text prompt among them
    return HFRolloutEngine(model, tok).generate(prompts, SamplingParams(n=n, temperature=1.0, max_new_tokens=10,
                                                                        seed=3))
