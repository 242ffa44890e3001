"""Seed 004's training_worker.py and run_distributed.py refuse, before anything starts or is written, what the
trainer would refuse once running, in the flags' own words; the seed's checkpoint interval and the batch its three
training processes take."""

from pathlib import Path

import pytest
import torch

from alignrl.runtime.ports import free_ports
from conftest import one_line


@pytest.mark.parametrize("case", ["port", "host", "past", "elsewhere"])
def test_run_distributed_checks_what_the_trainer_would_refuse_before_its_sampler_starts(case, capsys, monkeypatch,
                                                                                      tmp_path):
    """A port another program holds, binding beyond loopback without a token, a checkpoint past --max-steps: the
    trainer refused them once started, after the sampler had said it waits for a trainer (and after deepspeed.json
    was rewritten)."""
    import socket

    from alignrl.compat import zmq_launcher as seed004_launch
    from alignrl.train.checkpoint import write_manifest

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ALIGNRL_ZMQ_TOKEN", raising=False)
    monkeypatch.setattr(seed004_launch.subprocess, "Popen", None)
    data, sync = free_ports(2)
    argv = ["--training-gpus", "1", "--data-port", str(data), "--sync-port", str(sync)]
    holder = socket.socket()
    try:
        if case == "port":
            holder.bind(("127.0.0.1", sync))
            holder.listen()
            said = f"--sync-port {sync} is in use on 127.0.0.1"
        elif case == "host":
            argv += ["--host", "0.0.0.0"]
            said = "--host 0.0.0.0: refusing to bind 0.0.0.0 without a shared token"
        elif case == "elsewhere":
            argv += ["--host", "192.0.2.1"]  # TEST-NET-1: no machine's own address
            said = "--host 192.0.2.1 is not an address of this machine, where the trainer binds"
        else:
            step = tmp_path / "output" / "grpo_zmq" / "checkpoints" / "global_step_5"
            step.mkdir(parents=True)
            torch.save({"step": 5}, step / "trainer_state.pt")
            write_manifest(step)
            argv += ["--max-steps", "3"]
            said = f"the newest checkpoint, {Path('output/grpo_zmq/checkpoints/global_step_5')}, is past --max-steps 3"
        with pytest.raises(SystemExit) as e:
            seed004_launch.launcher_main(argv)
    finally:
        holder.close()
    assert e.value.code == 2
    assert one_line(capsys.readouterr().err).startswith(f"run_distributed.py: error: {said}")
    assert not (tmp_path / "deepspeed.json").exists()

def test_held_out_data_of_the_task_through_eval_data_path(trainer, capsys, tmp_path):
    """--data-path alone left the held-out accuracy on synthetic arithmetic, whatever the task."""
    from alignrl.config import load_config

    held = tmp_path / "test.jsonl"
    held.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    code, overrides, err = trainer(["--no-deepspeed", "--eval-data-path", held], capsys)
    assert code == 0 and load_config(None, overrides).data.val_files == str(held), err
    code, overrides, err = trainer(["--eval-data-path", "/nonexistent.jsonl"], capsys)
    assert code == 2 and overrides is None
    assert one_line(err).startswith("training_worker.py: error: --eval-data-path /nonexistent.jsonl: no such file; "
                                    "give the held-out data")

def test_training_worker_names_its_flags_not_the_config_keys_they_set(trainer, capsys):
    code, overrides, err = trainer(["--max-steps", "0"], capsys)
    assert code == 2 and overrides is None
    assert one_line(err) == "training_worker.py: error: --max-steps 0 is out of range; it must be >= 1"

def test_training_worker_names_a_bad_save_steps_data_path_and_model_path(trainer, capsys):
    code, overrides, err = trainer(["--save-steps", "-1"], capsys)
    assert code == 2 and overrides is None
    assert one_line(err).startswith("training_worker.py: error: --save-steps -1")
    code, overrides, err = trainer(["--data-path", "/nonexistent.jsonl"], capsys)
    assert code == 2 and overrides is None
    assert one_line(err).startswith("training_worker.py: error: --data-path /nonexistent.jsonl: no such file")
    code, overrides, err = trainer(["--model-path", "/nope"], capsys)
    assert code == 2 and overrides is None
    assert one_line(err).startswith("training_worker.py: error: --model-path='/nope' is not a Hugging Face model")

def test_a_data_file_whose_rows_cannot_be_read_is_named_before_deepspeed_json_is_written(trainer, capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\n')
    code, overrides, err = trainer(["--data-path", bad], capsys)
    assert code == 2 and overrides is None
    assert one_line(err).startswith(f"training_worker.py: error: {bad}: cannot tell the data format from columns")
    assert not (tmp_path / "deepspeed.json").exists()  # it was written before the rows were read


def test_the_seeds_three_training_processes_take_a_batch_that_splits_over_them(trainer, capsys):
    """`run_distributed.py --training-gpus "1,2,3"` as the seed writes it: the default 32 prompts a step do not split
    over 3 ranks (each takes whole prompts, in whole micro-batches of 64 sequences), so the trainer takes 24 and says
so; a batch given is kept (or refused)."""
    from alignrl.config import load_config

    code, overrides, err = trainer(["--nproc", "3"], capsys)
    assert code == 0 and overrides is not None, err
    cfg = load_config(None, overrides)
    assert (cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size) == (24, 24)
    assert "3 training processes: 24 prompts a step (the default 32 does not split evenly" in err, err
    code, overrides, err = trainer(["--nproc", "3", "--batch-size", "32"], capsys)
    assert code == 2 and overrides is None and "32" in one_line(err), err

@pytest.mark.parametrize("argv, freq", [([], 1000), (["--save-steps", "2"], 2), (["trainer.save_freq=5"], 5)])
def test_checkpoints_every_1000_steps_as_the_seed_says(trainer, capsys, argv, freq):
    from alignrl.config import load_config

    code, overrides, err = trainer(["--no-deepspeed", "--nproc", "2", *argv], capsys)
    assert code == 0 and overrides is not None, err
    assert load_config(None, overrides).trainer.save_freq == freq
