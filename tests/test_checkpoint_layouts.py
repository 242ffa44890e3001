"""Offline runs' checkpoints in TRL's layout (output_dir/checkpoint-N, each a model folder, one at the last step) and
verl's (default_local_dir/global_step_N/huggingface, the tracker file), kept to save_total_limit, written at epoch
ends, and found again by resume_from=auto; the final save keeps them where they are."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from alignrl.preference.checkpoint_plan import LAYOUTS, CheckpointPlan
from alignrl.preference.sft_cli import sft_main

ROWS = [{"prompt": f"count from {i}", "completion": " ".join(str(i + k) for k in range(1 + i % 4))} for i in range(8)]


def _data(tmp: Path) -> str:
    path = tmp / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return str(path)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def _trl(model: Path, tmp: Path, name: str, *extra: str) -> Path:
    out = tmp / name
    rc = sft_main([f"model_path={model}", f"train_files=[{_data(tmp)}]", "--output_dir", str(out), "--logging_dir",
                   str(tmp / f"logs_{name}"), "report_to=[jsonl]", "checkpoint_layout=trl", "batch_size=2",
                   "max_steps=4", "learning_rate=1e-3", "save_steps=2", "log_every=1", *extra])
    assert rc == 0
    return out


def test_trl_layout_keeps_checkpoints_beside_the_final_model_and_resume_auto_finds_them(tiny_model_dir, tmp_path):
    whole = _trl(tiny_model_dir, tmp_path, "whole", f"eval_files=[{_data(tmp_path)}]", "eval_steps=2")
    # step 2's and the last step's (as TRL's), beside the final model
    assert sorted(p.name for p in whole.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    _same(_weights(whole / "checkpoint-4"), _weights(whole))  # each checkpoint is a model folder too
    assert (whole / "checkpoint-4" / "tokenizer_config.json").is_file()
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(str(whole / "checkpoint-4")) is not None
    from transformers import TrainerState  # each checkpoint's trainer_state.json, as transformers reads it

    state = TrainerState.load_from_json(str(whole / "checkpoint-4" / "trainer_state.json"))
    assert (state.global_step, state.max_steps, state.save_steps) == (4, 4, 2)
    # the rows recorded before the checkpoint was written, its own step's training row too (as transformers logs
    # before it saves)
    assert [r["step"] for r in state.log_history if "loss" in r] == [1, 2, 3, 4]
    assert all("learning_rate" in r and "grad_norm" in r for r in state.log_history if "loss" in r)
    # and the held-out measure of the step that saves (transformers evaluates before it saves; the last step's is
    # the run's final measure, after it)
    early = TrainerState.load_from_json(str(whole / "checkpoint-2" / "trainer_state.json")).log_history
    assert [r["step"] for r in early if "eval_loss" in r] == [2] == [r["step"] for r in state.log_history
                                                                    if "eval_loss" in r], early
    # a run stopped after step 2 holds checkpoint-2 alone: resume_from=auto goes on from it
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(whole / "checkpoint-2", resumed / "checkpoint-2")
    _trl(tiny_model_dir, tmp_path, "resumed", "resume_from=auto", "save_total_limit=1")
    # step 2's went once step 4's was in place
    assert sorted(p.name for p in resumed.glob("checkpoint-*")) == ["checkpoint-4"]
    _same(_weights(resumed), _weights(whole))  # the steps after the checkpoint were those of the unbroken run
    log = (tmp_path / "logs_resumed" / "metrics.jsonl").read_text()
    assert [json.loads(r)["step"] for r in log.splitlines() if "loss" in r] == [3, 4]


def test_a_verl_line_writes_global_steps_with_huggingface_folders_and_evaluates_at_epoch_ends(
        tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "sft"
    line = [f"data.train_files={_data(tmp_path)}", "data.train_batch_size=4", "data.micro_batch_size_per_gpu=2",
            f"model.path={tiny_model_dir}", "trainer.total_epochs=2", "trainer.save_freq=after_each_epoch",
            "trainer.max_ckpt_to_keep=1", f"trainer.default_local_dir={out}", "trainer.logger=['console']",
            "optim.lr=1e-3", "--logging_dir", str(tmp_path / "logs"), f"data.val_files={_data(tmp_path)}",
            "trainer.test_freq=after_each_epoch"]
    assert sft_main(line) == 0
    # 8 rows / 4 a step: epochs end at steps 2 and 4; one kept; verl's tracker names the newest
    assert sorted(p.name for p in out.glob("global_step_*")) == ["global_step_4"]
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "4"
    _same(_weights(out / "global_step_4" / "huggingface"), _weights(out))
    assert "resume_from=auto: no checkpoint in" in capsys.readouterr().out  # verl's resume_mode=auto, a first run
    rows = [json.loads(r) for r in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/loss" in r] == [2, 4]  # the first epoch's end, and the run's


def test_plans_say_when_a_checkpoint_is_due_and_rotate_the_oldest(tmp_path):
    def plan(layout, strategy="steps", every=2, keep=0):
        return CheckpointPlan(tmp_path, LAYOUTS[layout], strategy, every, 3, 7, keep)

    assert [s for s in range(1, 8) if plan("alignrl").due(s)] == [2, 4, 6]  # the final model is step 7's
    assert [s for s in range(1, 8) if plan("trl").due(s)] == [2, 4, 6, 7]
    assert [s for s in range(1, 8) if plan("verl", "epoch").due(s)] == [3, 6, 7]
    assert not any(plan("trl", "no").due(s) for s in range(1, 8))
    for step in (1, 2, 3):
        folder = tmp_path / f"step_{step}"
        folder.mkdir()
        (folder / "weights.safetensors").write_text("x")
        (folder / "state.json").write_text("{}")
    (tmp_path / "step_9").mkdir()  # not complete: never the latest, never counted
    assert plan("alignrl").latest() == tmp_path / "step_3"
    assert plan("alignrl").inside(tmp_path / "elsewhere") == []
    assert plan("alignrl").inside(tmp_path) == [tmp_path / f"step_{s}" for s in (1, 2, 3)]
    from alignrl.preference.checkpoint_plan import _rotate

    _rotate(plan("alignrl", keep=2), tmp_path / "step_3")  # the newest two stay, the older go
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_2", "step_3", "step_9"]


@pytest.mark.parametrize("flags, says", [(["--save_total_limit", "2", "--save_strategy", "epoch"],
                                          ("save_total_limit", 2, "save_strategy", "epoch")),
                                         (["--resume_from_checkpoint", "True"], ("resume_from", "latest", None, None))])
def test_trl_checkpoint_flags(flags, says, tmp_path):
    from alignrl.preference.sft_cli import parse_sft

    cfg = parse_sft(["--model_name_or_path", "demo", "--dataset_name", _data(tmp_path), "--output_dir",
                     str(tmp_path / "o"), *flags])
    assert cfg.checkpoint_layout == "trl" and getattr(cfg, says[0]) == says[1]
    if says[2]:
        assert getattr(cfg, says[2]) == says[3]


def test_a_fresh_run_in_a_reused_folder_sets_the_old_checkpoints_aside(tiny_model_dir, tmp_path, capsys):
    """Another run's checkpoints in the output folder are moved aside (named, not deleted) when a fresh run starts:
    rotation and resume_from=auto then see this run's alone; a checkpoint past the run's last step is one line."""
    out = _trl(tiny_model_dir, tmp_path, "o")  # checkpoint-2, checkpoint-4
    _trl(tiny_model_dir, tmp_path, "o", "max_steps=2", "seed=7", "save_total_limit=1")
    assert sorted(p.name for p in out.glob("checkpoint-*") if "previous" not in p.name) == ["checkpoint-2"]
    # the first run's, kept: set aside at the start, then moved with its final model when this run's was saved
    aside = sorted(p.name.split(".previous")[0] for p in tmp_path.glob("o.previous*/checkpoint-*.previous*"))
    assert aside == ["checkpoint-2", "checkpoint-4"]
    whole = _trl(tiny_model_dir, tmp_path, "whole", f"eval_files=[{_data(tmp_path)}]", "eval_steps=2")
    past = tmp_path / "past"
    past.mkdir()
    shutil.copytree(whole / "checkpoint-4", past / "checkpoint-4")
    rc = sft_main([f"model_path={tiny_model_dir}", f"train_files=[{_data(tmp_path)}]", "--output_dir", str(past),
                   "report_to=[jsonl]", "checkpoint_layout=trl", "batch_size=2", "max_steps=2", "save_steps=2",
                   "resume_from=auto", "--logging_dir", str(tmp_path / "logs_past")])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and "the checkpoint is step 4, past this run's last step 2" in err and err.count("\n") == 0, err
    # TRL's --resume_from_checkpoint true (resume_from=latest) with no checkpoint to go on from: one line, as
    # transformers' "No valid checkpoint found"
    rc = sft_main([f"model_path={tiny_model_dir}", f"train_files=[{_data(tmp_path)}]", "--output_dir",
                   str(tmp_path / "empty"), "report_to=[jsonl]", "checkpoint_layout=trl", "batch_size=2",
                   "max_steps=2", "resume_from=latest", "--logging_dir", str(tmp_path / "logs_empty")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "no checkpoint in" in err and "drop it to start from" in err, err


def test_logs_inside_the_checkpoints_inside_the_output_stay_where_they_were(tiny_model_dir, tmp_path):
    out = tmp_path / "o"
    rc = sft_main([f"model_path={tiny_model_dir}", f"train_files=[{_data(tmp_path)}]", "--output_dir", str(out),
                   "--logging_dir", str(out / "ck" / "logs"), f"checkpoint_dir={out / 'ck'}", "report_to=[jsonl]",
                   "batch_size=2", "max_steps=2", "save_steps=1"])
    assert rc == 0
    assert (out / "ck" / "step_1" / "weights.safetensors").is_file() and (out / "model.safetensors").is_file()
    assert (out / "ck" / "logs" / "metrics.jsonl").is_file()


def test_a_reward_models_checkpoints_say_what_their_score_means(tiny_model_dir, tmp_path):
    """A scorer's model folder in a checkpoint carries alignrl_score.json as the final one does, so that a cost
    model's checkpoint is refused where a reward model is asked for."""
    from alignrl.preference.cli import rm_main

    out, repo = tmp_path / "rm", Path(__file__).parents[1]
    assert rm_main(["--config", str(repo / "configs/rm_config.yaml"), "--task", "helpful", "--output_dir", str(out),
                    "--logging_dir", str(tmp_path / "logs_rm"), f"model_path={tiny_model_dir}", "max_train_pairs=8",
                    "max_eval_pairs=8", "batch_size=4", "report_to=[jsonl]", "checkpoint_layout=verl",
                    "save_steps=1"]) == 0
    final = json.loads((out / "alignrl_score.json").read_text())
    assert json.loads((out / "global_step_1" / "huggingface" / "alignrl_score.json").read_text()) == final


def test_trls_ratio_form_of_save_and_eval_steps():
    from alignrl.preference.checkpoint_plan import every_steps

    assert [every_steps(v, 8) for v in (0.25, 0.01, 3, 0, 0.5)] == [2, 1, 3, 0, 4]  # rounded up, as transformers
    from alignrl.config import ConfigError

    with pytest.raises(ConfigError, match="no fraction above 1"):
        every_steps(2.5, 8)


def test_a_held_out_measure_between_logged_steps_is_recorded(tiny_model_dir, tmp_path):
    """eval_steps 3 with log_every 2 (TRL's --eval_steps apart from --logging_steps): step 3's held-out loss is a
    row of its own, not dropped with the unlogged step's metrics."""
    _trl(tiny_model_dir, tmp_path, "o", f"eval_files=[{_data(tmp_path)}]", "log_every=2", "eval_strategy=steps",
         "eval_steps=3", "save_strategy=no")
    rows = [json.loads(x) for x in (tmp_path / "logs_o" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [2, 4]
    assert [r["step"] for r in rows if "eval/loss" in r] == [3, 4], rows
