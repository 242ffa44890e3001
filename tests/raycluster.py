"""What the Ray tests share beside their `cluster` fixture (conftest.py): seed 001's flags, a small world for
this machine, the metrics of a run, seed 001's data and a reward model."""

import json
import re
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

SEED_001 = ["--ref_num_nodes", "2", "--ref_num_gpus_per_node", "4", "--actor_num_nodes", "2",
            "--actor_num_gpus_per_node", "4", "--vllm_num_engines", "2", "--vllm_tensor_parallel_size", "4",
            "--colocate_actor_ref", "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "8",
            "--rollout_batch_size", "128", "--train_batch_size", "128", "--micro_train_batch_size", "2",
            "--use_kl_loss", "--init_kl_coef", "0.001"]


def tiny(model_dir, save, steps, *extra):
    """Two actor ranks, one reference worker, one rollout engine: a small world for the 2-core machine."""
    return ["--pretrain", str(model_dir), "--save_path", str(save), "--actor_num_nodes", "1",
            "--actor_num_gpus_per_node", "2", "--ref_num_nodes", "1", "--ref_num_gpus_per_node", "1",
            "--vllm_num_engines", "1", "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4",
            "--rollout_batch_size", "4", "--train_batch_size", "8", "--micro_train_batch_size", "4",
            "--generate_max_len", "8", "--prompt_max_len", "64", "--max_samples", "64", "--use_kl_loss",
            "--init_kl_coef", "0.01", "--actor_learning_rate", "1e-3", "--val_size", "4",
            "--total_steps", str(steps), "--peer_timeout", "60", "--placement_timeout", "20", *extra]


def gpus_free_become(n: float, timeout: float = 15.0) -> bool:
    """Ray's view of free resources lags a created or removed placement group by a moment (seen: 4 GPUs still
    free after every group was CREATED)."""
    deadline = time.monotonic() + timeout
    while ray.available_resources().get("GPU", 0.0) != n:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


# A line Ray forwards from its own processes to the driver's stderr: "(raylet) ...", "(autoscaler +26s) ...",
# "(pid=12) ...", "(RolloutEngine pid=12, ip=...) ...", coloured or not (e.g. the raylet's warning of a nearly full
# disk, the autoscaler's of a request no node type fits).
RAY_FORWARDED = re.compile(r"^(\x1b\[[0-9;]*m)*\((raylet|autoscaler|\w* ?pid=)")


def own_lines(err: str) -> list[str]:
    """The non-blank stderr lines a run printed itself, without those Ray forwarded from its processes."""
    return [x for x in err.splitlines() if x.strip() and not RAY_FORWARDED.match(x.strip())]


def all_gpus_free() -> bool:
    return gpus_free_become(16.0)


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]


def seed_001_data(path: Path) -> list[str]:
    """OpenRLHF-style prompt data as seed 001's script reads it: `{"messages": [...], "answer": ...}` rows
    in a .json array, with its data flags."""
    from alignrl.data import synthetic

    rows = [{"messages": s.messages, "answer": s.ground_truth} for s in synthetic.generate("train", 64, seed=0)]
    path.write_text(json.dumps(rows))
    return ["--prompt_data", str(path), "--input_key", "messages", "--label_key", "answer", "--apply_chat_template"]


def reward_model(tiny_model_dir, folder: Path) -> Path:
    """A sequence-classification head (seeded) on the tiny model: a reward model whose scores differ by row."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(folder)
    return folder
