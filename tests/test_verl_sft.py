"""verl's SFT trainer lines on `alignrl train sft`: a real example's keys become the SFT config's values with verl's
meaning (global batch, micro batch, output folder, LoRA, schedule) and verl's defaults; keys that change nothing here
are listed once, values alignrl cannot give are one line; truncation error|left|right; a tiny run in verl's spelling;
the `python -m verl.trainer.sft_trainer` shims."""

import json
import os
import re
import runpy
import sys
from pathlib import Path

import pytest

from alignrl.config import ConfigError
from alignrl.preference.sft_cli import parse_sft, sft_main
from alignrl.preference.verl_sft_keys import launch_words

# examples/sft/gsm8k/run_qwen3_8b_fsdp.sh's line (USE_PEFT=1), its paths ours
QWEN3_8B = ["data.train_files=/data/gsm8k/train.parquet", "data.val_files=/data/gsm8k/test.parquet",
            "data.micro_batch_size_per_gpu=64", "data.messages_key=messages", "optim.lr=1e-4", "engine=fsdp",
            "engine.ulysses_sequence_parallel_size=2", "model.path=Qwen/Qwen3-8B", "model.use_remove_padding=true",
            "trainer.default_local_dir=/tmp/sft-ckpt", "trainer.project_name=gsm8k-sft",
            "trainer.experiment_name=gsm8k-sft-qwen3-8b-instruct", "trainer.logger=[\"console\",\"wandb\"]",
            "trainer.total_epochs=2", "model.lora_rank=32", "model.lora_alpha=16", "model.target_modules=all-linear"]
ROWS = [{"messages": [{"role": "user", "content": f"count from {i}"},
                      {"role": "assistant", "content": " ".join(str(i + k) for k in range(1 + i % 3))}]}
        for i in range(8)]


def test_a_verl_example_line_is_read_key_by_key(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # a rank of torchrun --nproc_per_node=2: verl's FSDP engine is FSDP2
    for name in ("WANDB_PROJECT", "WANDB_NAME"):
        monkeypatch.setenv(name, "")  # restored after the test, whatever the line sets
    cfg = parse_sft(QWEN3_8B)
    # trainer.project_name and experiment_name name the wandb project and run, as verl's
    assert (os.environ["WANDB_PROJECT"], os.environ["WANDB_NAME"]) == ("gsm8k-sft", "gsm8k-sft-qwen3-8b-instruct")
    assert (cfg.train_files, cfg.eval_files, cfg.messages_key) == (["/data/gsm8k/train.parquet"],
                                                                   ["/data/gsm8k/test.parquet"], "messages")
    assert (cfg.batch_size, cfg.eval_batch_size, cfg.train_batch_size) == (64, 64, 256)  # verl's global 256
    assert (cfg.learning_rate, cfg.model_path, cfg.output_dir, cfg.epochs) == (1e-4, "Qwen/Qwen3-8B", "/tmp/sft-ckpt",
                                                                                2)
    assert (cfg.use_lora, cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules) == (True, 32, 16, "all-linear")
    assert (cfg.strategy, cfg.report_to, cfg.truncation, cfg.max_length) == ("fsdp2", ["jsonl", "wandb"], "error",
                                                                              1024)
    assert (cfg.lr_scheduler, cfg.warmup_ratio, cfg.adam_betas, cfg.weight_decay) == ("constant", 0.0, [0.9, 0.999],
                                                                                      0.01)
    err = capsys.readouterr().err
    assert "verl's sft_trainer defaults taken: train_batch_size=256" in err
    assert "not applied here: engine.ulysses_sequence_parallel_size=2 (the engine's sharding" in err
    assert "trainer.logger" not in err and "lora_dropout=0.0" in err  # wandb is a sink here


def test_the_older_trainers_keys_and_defaults():
    cfg = parse_sft(["model.partial_pretrain=~/m", "data.train_files=[a.parquet,b.parquet]", "data.val_files=null",
                     "data.prompt_key=q", "data.train_batch_size=32", "data.micro_batch_size_per_gpu=2",
                     "optim.warmup_steps_ratio=0.05", "optim.betas=[0.9,0.98]", "optim.clip_grad=0.5",
                     "trainer.save_freq=-1", "trainer.test_freq=10", "trainer.total_training_steps=7",
                     "trainer.logger=[console,tensorboard]", "data.truncation=left", "use_remove_padding=true"])
    assert cfg.model_path.endswith("/m") and not cfg.model_path.startswith("~")
    assert (cfg.train_files, cfg.eval_files, cfg.prompt_key, cfg.response_key) == (["a.parquet", "b.parquet"], [],
                                                                                   "q", "answer")
    assert (cfg.warmup_ratio, cfg.adam_betas, cfg.grad_clip, cfg.lr_scheduler, cfg.learning_rate) == (
        0.05, [0.9, 0.98], 0.5, "cosine", 1e-5)
    assert (cfg.save_steps, cfg.eval_steps, cfg.max_steps, cfg.report_to, cfg.truncation) == (
        0, 10, 7, ["jsonl", "tensorboard"], "left")
    assert cfg.output_dir == "checkpoints/gsm8k-sft/test"  # verl's default_local_dir
    assert cfg.strategy == "ddp"  # FSDP2 shards over ranks; one process trains unsharded
    assert parse_sft(["data.train_files=t.jsonl", "engine=deepspeed"]).strategy == "deepspeed"


def test_resume_mode_auto_goes_on_from_the_newest_checkpoint(tmp_path):
    """verl's layout: default_local_dir/global_step_N; resume_mode=auto (its default) takes the newest complete one
    when the run starts, and the checkpoints are kept to trainer.max_ckpt_to_keep."""
    from alignrl.preference.checkpoint_plan import plan_for, resume_folder
    from alignrl.preference.checkpoints import STATE, WEIGHTS

    out = tmp_path / "ckpt"
    for step in (2, 10, 9, 12):
        folder = out / f"global_step_{step}"
        folder.mkdir(parents=True)
        for name in (WEIGHTS, STATE) if step != 12 else ():  # step 12 is not a whole checkpoint
            (folder / name).write_text("x")
    line = ["data.train_files=t.jsonl", f"trainer.default_local_dir={out}"]
    cfg = parse_sft([*line, "trainer.max_ckpt_to_keep=2", "trainer.save_freq=after_each_epoch"])
    assert (cfg.resume_from, cfg.checkpoint_layout, cfg.save_total_limit, cfg.save_strategy) == (
        "auto", "verl", 2, "epoch")
    said = []
    log = type("Log", (), {"print": staticmethod(said.append)})
    assert resume_folder(cfg, plan_for(cfg, out, 20, 5), log) == str(out / "global_step_10")
    assert "going on from" in said[-1]
    assert resume_folder(cfg, plan_for(cfg, tmp_path / "new", 20, 5), log) is None  # a first run
    assert "no checkpoint in" in said[-1]
    assert parse_sft(line).save_total_limit == 0  # verl keeps every checkpoint by default
    assert parse_sft([*line, "trainer.resume_mode=disable"]).resume_from is None
    assert parse_sft([*line, "trainer.resume_mode=resume_path", "trainer.resume_from_path=x"]).resume_from == "x"
    assert parse_sft([*line, "resume_from=y"]).resume_from == "y"  # the line's own key: no search
    with pytest.raises(ConfigError, match="resume_mode=resume_path goes on from trainer.resume_from_path: give it"):
        parse_sft([*line, "trainer.resume_mode=resume_path"])


@pytest.mark.parametrize("word, says", [
    ("model.use_liger=true", "Liger kernels are left out"), ("engine=megatron", "not on Megatron"),
    ("optim.lr_scheduler_type=wsd", "WSD is left out"), ("data.custom_cls.path=x.py", "custom dataset class"),
    ("data.foo=1", "unknown verl SFT key 'data.foo'"), ("trainer.save_freq=every_epoch", "must be a number")])
def test_what_alignrl_cannot_do_is_one_line(word, says):
    with pytest.raises(ConfigError, match=says):
        parse_sft(["data.train_files=t.jsonl", "model.path=demo", word])


def test_ranks_follow_the_rl_side(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    line = ["model.path=demo", "trainer.nnodes=1", "trainer.n_gpus_per_node=2"]
    assert launch_words(line) == [*line, "--nproc", "2"]
    assert launch_words([*line, "--nproc", "1"]) == [*line, "--nproc", "1"]
    monkeypatch.setenv("WORLD_SIZE", "4")  # a torchrun rank: torchrun's world trains
    assert launch_words(line) == line


def test_truncation_error_left_right(tiny_model_dir, tmp_path):
    from alignrl.models.loader import load_tokenizer
    from alignrl.preference.sft import _encode, _keys, _load

    class Quiet:
        def print(self, *_):
            pass

    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    tok = load_tokenizer(tiny_model_dir, chat=False)
    full = None
    for mode in ("right", "left", "error"):
        cfg = parse_sft([f"data.train_files={data}", f"model.path={tiny_model_dir}", "data.max_length=31",
                         f"data.truncation={mode}"])
        rows = _load(cfg.train_files, _keys(cfg, True), 0, "train_files")
        if mode == "error":
            with pytest.raises(ConfigError, match=r"8 training rows are longer than max_length=31 .*truncation=error"):
                _encode(tok, cfg, rows, [], Quiet())
            continue
        enc, _, notes = _encode(tok, cfg, rows, [], Quiet())
        assert notes["truncated_rows"] == len(enc) == 8 and all(len(e.ids) == 31 for e in enc)
        if full is None:
            full, _, _ = _encode(tok, parse_sft([f"data.train_files={data}", "data.max_length=1024"]), rows, [],
                                 Quiet())
        cut = [f.ids[:31] if mode == "right" else f.ids[-31:] for f in full]
        assert [e.ids for e in enc] == cut


def test_a_tiny_run_in_verls_spelling(tiny_model_dir, tmp_path):
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "sft"
    rc = sft_main([f"data.train_files={data}", f"data.val_files={data}", f"model.path={tiny_model_dir}",
                   "data.train_batch_size=4", "data.micro_batch_size_per_gpu=2", "optim.lr=1e-3", "engine=fsdp",
                   "trainer.total_epochs=1", f"trainer.default_local_dir={out}", "trainer.logger=[console]",
                   "model.enable_gradient_checkpointing=false", "--logging_dir", str(tmp_path / "logs")])
    assert rc == 0
    res = json.loads((out / "eval_results.json").read_text())
    # 8 rows, a global batch of 4 as 2 micro-batches of 2: 2 steps, the held-out loss measured before and after
    assert (res["steps"], res["effective_batch"]) == (2, 4)
    assert res["after"]["loss"] < res["before"]["loss"]


def test_the_shims_run_the_sft_command(monkeypatch, capsys):
    root = Path(__file__).parents[1]
    monkeypatch.syspath_prepend(str(root))
    for module in ("verl.trainer.sft_trainer", "verl.trainer.fsdp_sft_trainer"):
        monkeypatch.setattr(sys, "argv", [module, "data.train_files=t.jsonl", "model.use_liger=true"])
        with pytest.raises(SystemExit) as stop:
            runpy.run_module(module, run_name="__main__")
        assert stop.value.code == 2
        assert "verl's model.use_liger=true: Liger kernels are left out" in capsys.readouterr().err


def test_rows_sft_cannot_train_as_they_ask_are_one_line(tmp_path):
    """verl's video SFT rows, turns marked untrained and tool calls it cannot read: trained on their text alone they
    would teach something else, so each is one line naming its row (rows with images: tests/test_sft_images.py;
    tools and tool calls: tests/test_sft_tools.py)."""
    from alignrl.data.loaders import DataError
    from alignrl.data.sft_rows import SFTKeys, load_rows

    turns = [{"role": "user", "content": "<image>What is this?"}, {"role": "assistant", "content": "a cat"}]
    for extra, words in (({"videos": [{"bytes": b"x"}]}, r"has videos \(videos\)"),
                         ({"messages": turns[:1] + [{**turns[1], "trainable": False}]}, "has trainable"),
                         ({"messages": turns[:1] + [{**turns[1], "tool_calls": [{"name": "f"}]}]},
                          "a tool call in messages must")):
        path = tmp_path / "rows.jsonl"
        path.write_text(json.dumps({"messages": turns, **extra}, default=str) + "\n")
        with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:1: .*{words}"):
            load_rows(str(path), SFTKeys())
    path.write_text(json.dumps({"messages": turns, "images": [], "tools": None}) + "\n")
    assert len(load_rows(str(path), SFTKeys())) == 1  # empty columns hold nothing


def test_verl_vision_sft_keys_name_the_image_column():
    assert parse_sft(["data.train_files=t.jsonl", "data.image_key=pictures"]).image_key == "pictures"
