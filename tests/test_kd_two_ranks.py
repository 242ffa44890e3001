"""GKD's generations (`alignrl train kd` with lmbda) on two ranks: two ranks of ddp, DeepSpeed ZeRO-3 and fsdp2,
each taking half of every optimizer step's rows, log the losses, draws and completion lengths and save the
weights of one process accumulating the same global batches. That holds because every rank draws the step's kind
(the student's generations or the rows) alike, each row samples from a seed of its own whatever rank or micro-batch it
sits in, and the step's token count adds every rank's generated tokens once. The student ends its completions at
different lengths, so the ranks' micro-batches finish generating after different numbers of forwards: a sharded
student (fsdp2, ZeRO-3), whose forwards gather weights from both ranks, must keep every rank in them."""

import contextlib
import io
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from alignrl.preference.kd_cli import kd_main, parse_kd
from alignrl.preference.kd_onpolicy import draws_student
from alignrl.preference.sft_cli import sft_main

ROWS = [{"prompt": f"count from {i}", "completion": " ".join(str(i + k) for k in range(1 + i % 4))} for i in range(16)]
MAX_NEW = 8
# lmbda 0.5 with seed 42 draws the student's generations at step 0 and the rows at step 1 (asserted below)
STEPS = ["max_steps=2", "learning_rate=1e-3", "warmup_ratio=0", "max_length=40", f"max_new_tokens={MAX_NEW}",
         "kd_coef=0.5", "batch_size=2", "log_every=1", "report_to=[jsonl]"]


def _data(tmp: Path) -> Path:
    path = tmp / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(the student: the tiny model after a few SFT epochs on the rows, so its completions end at eos after varied
    lengths; the teacher: the tiny model as it is, another distribution to distil)."""
    tmp = tmp_path_factory.mktemp("student")
    assert sft_main([f"model_path={tiny_model_dir}", f"train_files=[{_data(tmp)}]", "--output_dir",
                     str(tmp / "student"), "--logging_dir", str(tmp / "logs"), "batch_size=4", "epochs=4",
                     "learning_rate=1e-2", "warmup_ratio=0"]) == 0
    return tmp / "student", tiny_model_dir


def _line(models: tuple[Path, Path], tmp: Path, name: str, lmbda: float, seq_kd: bool = False) -> list[str]:
    return [f"model_path={models[0]}", f"teacher_model_path={models[1]}", f"train_files=[{_data(tmp)}]",
            "--output_dir", str(tmp / name), "--logging_dir", str(tmp / f"logs_{name}"), f"lmbda={lmbda}",
            f"seq_kd={seq_kd}", *STEPS]


def _read(tmp: Path, name: str) -> tuple[list[dict], dict[str, torch.Tensor], dict]:
    """(the logged steps, the saved weights, eval_results.json): read once the folder is renamed into place."""
    from safetensors.torch import load_file

    metrics = [json.loads(x) for x in (tmp / f"logs_{name}" / "metrics.jsonl").read_text().splitlines()]
    return (metrics, load_file(str(tmp / name / "model.safetensors")),
            json.loads((tmp / name / "eval_results.json").read_text()))


@pytest.fixture(scope="module")
def one_process(models, tmp_path_factory):
    """`one_process(lmbda, seq_kd)`: the run in this process (one thread, as each rank has), 2 micro-batches of 2
    rows per step: the global batch of two ranks of 2 rows; made once per (lmbda, seq_kd)."""
    tmp, done = tmp_path_factory.mktemp("one"), {}

    def run(lmbda: float, seq_kd: bool, *extra: str):
        name = "_".join(["one", str(lmbda), str(seq_kd), *extra])
        if name not in done:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                line = _line(models, tmp, name, lmbda, seq_kd)
                assert kd_main(line + ["strategy=single", "gradient_accumulation_steps=2", *extra]) == 0
            finally:
                torch.set_num_threads(threads)
            done[name] = _read(tmp, name)
        return done[name]

    return run


@pytest.fixture(scope="module")
def swapped_one_process(models, tmp_path_factory):
    """The sharded-teacher runs' reference, made once: the SFT-trained model teaching the tiny one with seq_kd in this
    process (one thread, 2 micro-batches of 2 rows per step, as two ranks of 2 rows); (the MiB of the whole teacher
    its start line names, `_read`'s logs, weights and results)."""
    tmp, out = tmp_path_factory.mktemp("one_swapped"), io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out):
            assert kd_main(_line((models[1], models[0]), tmp, "one", 0.0, True)
                           + ["strategy=single", "gradient_accumulation_steps=2"]) == 0
    finally:
        torch.set_num_threads(threads)
    whole = re.search(r"teacher: a whole copy on each rank, ([\d.]+) MiB per rank", out.getvalue())
    assert whole, out.getvalue()[-2000:]
    return float(whole[1]), _read(tmp, "one")


def _longest_per_rank(models: tuple[Path, Path], tmp: Path) -> list[int]:
    """The longest of each rank's step-0 completions (the forwards its generation runs), as the run samples them:
    the rows each rank takes at step 0, their prompts, and the rows' own seeds."""
    from alignrl.data.sft_rows import collate_rows
    from alignrl.models.loader import load_model
    from alignrl.preference import common as pc
    from alignrl.preference.kd_onpolicy import prompts_of, row_seed, sample
    from alignrl.preference.sft import QUIET, _encode, _keys, _load

    cfg = parse_kd(_line(models, tmp, "probe", 1.0)[:3] + ["lmbda=1", *STEPS])
    model, tok = load_model(str(models[0]))
    encoded, _, _ = _encode(tok, cfg, _load(list(cfg.train_files), _keys(cfg, False), 0, "train_files"), [], QUIET)
    longest = []
    for rank in (0, 1):
        rows = pc.micro_batches(len(encoded), cfg, 2, rank, 0)[0]
        batch = collate_rows([encoded[j] for j in rows], tok.pad_token_id, 1.0)
        made = sample(model, prompts_of(batch), tok.pad_token_id, tok.eos_token_id, cfg, torch.device("cpu"),
                      [row_seed(cfg.seed, 0, j) for j in rows])
        longest.append(max(map(len, made)))
    return longest


def test_the_ranks_generations_end_after_different_numbers_of_forwards(models, tmp_path):
    """What makes the sharded runs below a test of generating in step: at step 0 one rank's rows are all done
    before the other's."""
    longest = _longest_per_rank(models, tmp_path)
    assert len(set(longest)) == 2 and min(longest) < MAX_NEW, longest


@pytest.mark.slow
# (ddp with lmbda=1 is fsdp2's case on whole weights: the mixed draw on ddp covers it)
# (a LoRA student's generate is PEFT's, which skips the FSDP2 root's forward unless it is hooked too)
@pytest.mark.parametrize("strategy, lmbda, seq_kd", [("ddp", 0.5, False), ("fsdp2", 1.0, False),
                                                     ("fsdp2 use_lora=true lora_rank=4 lora_dropout=0", 1.0, False),
                                                     ("deepspeed zero_stage=3", 0.5, True)])
def test_two_ranks_take_one_process_steps(models, one_process, tmp_path, strategy, lmbda, seq_kd):
    """seq_kd: the step the draw leaves to the rows trains on the teacher's generations (sharded beside the ZeRO-3
    student, as the last test checks)."""
    from conftest import run_group

    name = strategy.split()[0]
    line = _line(models, tmp_path, name, lmbda, seq_kd) + [f"strategy={name}", *strategy.split()[1:]]
    p = run_group([sys.executable, "-m", "alignrl", "train", "kd", "--nproc", "2", *line], 240,
                  env={**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": "60"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    lora = [w for w in strategy.split() if w.startswith(("use_lora", "lora_"))]
    (ranks, weights, results), (one, one_weights, _) = _read(tmp_path, name), one_process(lmbda, seq_kd, *lora)
    assert (results["world_size"], results["strategy"], results["lmbda"], results["seq_kd"]) == (2, name, lmbda,
                                                                                                seq_kd)
    drawn = [float(draws_student(42, step, lmbda)) for step in (0, 1)]
    assert drawn == ([1.0, 1.0] if lmbda == 1 else [1.0, 0.0])  # a mixed run has one step of each kind
    assert [r["train/on_policy"] for r in ranks] == [r["train/on_policy"] for r in one] == drawn
    # a generated step's loss is distil_loss alone, over the generated tokens of both ranks counted once
    assert [("train/gpt_loss" in r) for r in ranks] == [not (d or seq_kd) for d in drawn]
    for mine, theirs in zip(ranks, one):
        assert mine["train/loss"] == pytest.approx(theirs["train/loss"], rel=1e-5)
        assert mine["train/completion_length"] == pytest.approx(theirs["train/completion_length"], rel=1e-6)
    assert 0 < ranks[0]["train/completion_length"] < MAX_NEW  # some completions ended at eos
    from safetensors.torch import load_file

    start = load_file(str(models[0] / "model.safetensors"))
    assert weights.keys() == one_weights.keys() == start.keys()
    assert max(float((one_weights[k] - start[k]).abs().max()) for k in start) > 1e-4  # it trained
    for k in weights:  # Adam's first steps magnify the ranks' other order of summing; still far below the update
        torch.testing.assert_close(weights[k], one_weights[k], rtol=0, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("strategy, beside", [("fsdp2", ""),
                                              ("deepspeed zero_stage=3", " beside the student's ZeRO-3 partitions")])
def test_a_sharded_student_shards_the_teacher_and_takes_one_process_steps(models, swapped_one_process, tmp_path,
                                                                          strategy, beside):
    """Under fsdp2 and ZeRO-3 the teacher is sharded over the two ranks too (by FSDP2, beside a DeepSpeed student as
    well; said at start, with its bytes per rank), and a seq_kd run (lmbda=0: every step trains on the teacher's
    generations, the teacher's forwards in the loss too) takes the steps of one process with a whole teacher. The
    SFT-trained model teaches here and the tiny one learns, so the teacher's step-0 generations end after different
    numbers of forwards on the two ranks (the first test above samples them), which a sharded teacher must generate in
    step."""
    from conftest import run_group

    name = strategy.split()[0]
    swapped = (models[1], models[0])  # (student, teacher)
    p = run_group([sys.executable, "-m", "alignrl", "train", "kd", "--nproc", "2",
                   *_line(swapped, tmp_path, name, 0.0, True), f"strategy={name}", *strategy.split()[1:]], 240,
                  env={**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": "60"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    sharded = re.search(rf"teacher: sharded over 2 ranks \(FSDP2\){beside}, ([\d.]+) MiB of its weights per rank",
                        p.stdout)
    assert sharded, p.stdout[-2000:]
    whole, (one, one_weights, _) = swapped_one_process
    assert float(sharded[1]) <= whole / 2 + 0.01  # each rank holds its half (rounded to 0.01)
    ranks, weights, results = _read(tmp_path, name)
    assert (results["world_size"], results["strategy"], results["seq_kd"]) == (2, name, True)
    assert not any("train/gpt_loss" in r for r in ranks)  # the teacher's generations: distil_loss alone
    for mine, theirs in zip(ranks, one, strict=True):
        assert mine["train/loss"] == pytest.approx(theirs["train/loss"], rel=1e-5)
        assert mine["train/completion_length"] == pytest.approx(theirs["train/completion_length"], rel=1e-6)
    assert 0 < ranks[0]["train/completion_length"] < MAX_NEW  # some of the teacher's completions ended at eos
    from safetensors.torch import load_file

    start = load_file(str(swapped[0] / "model.safetensors"))
    assert max(float((one_weights[k] - start[k]).abs().max()) for k in start) > 1e-4  # it trained
    for k in weights:
        torch.testing.assert_close(weights[k], one_weights[k], rtol=0, atol=2e-5)
