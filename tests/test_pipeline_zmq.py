"""The ZeroMQ placement end to end: a trainer (`alignrl train grpo pipeline.placement=zmq`) and sampler
processes (`alignrl sample`) on loopback, with the tiny model. Every process is stopped by its PID."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from alignrl.runner import train_grpo
from alignrl.config import load_config
from alignrl.runtime.ports import free_ports
from conftest import SRC, src_path
from zmqpipeline import (assert_each_row_once, finish, overrides, sampler, samplers_logged, spawn,
                         steps_logged, stop, trained_rows, wait_for, weights)

@pytest.mark.timeout(400)
def test_on_policy_pipeline_matches_the_in_process_loop(tiny_model_dir, tmp_path):
    """k = 0, one sampler: the same batches in the same order with the same seeds, so the same weights. The
    weights reach the sampler through memory both map (shared memory on the CPU, CUDA IPC on a GPU); the
    frames on the sync port carry them in the other tests."""
    ports = free_ports(2)
    steps = 3
    train_grpo(load_config(None, overrides(tiny_model_dir, tmp_path, "inline", steps, ports)))
    trainer = spawn("train", "grpo", *overrides(tiny_model_dir, tmp_path, "zmq", steps, ports,
                                                 "pipeline.placement=zmq", "pipeline.peer_timeout_s=120",
                                                 "pipeline.weight_transport=shared"))
    out, _ = finish(trainer, sampler(tiny_model_dir, ports))
    shared = "through CUDA IPC" if torch.cuda.is_available() else "through shared memory"
    assert f"receives the weights {shared}" in out, out[-2000:]
    a, b = weights(tmp_path / "inline", steps), weights(tmp_path / "zmq", steps)
    for k in a:  # the sampler's fp32 forward equals the trainer's: no tolerance needed
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    rows = [json.loads(x) for x in (tmp_path / "zmq" / "logs" / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["pipeline/staleness"] for r in rows] == [0.0] * steps
    assert len(trained_rows(tmp_path / "zmq")) == steps


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_killed_sampler_loses_nothing(tiny_model_dir, tmp_path):
    """k = 1 (with truncated IS, the reference forward on the trainer), two samplers; one is killed mid-run and
    the other hangs (SIGSTOP): their heartbeats stop, so a lease either holds goes back to the queue after
    pipeline.heartbeat_timeout_s (the lease timeout stays at its 600 s default; test_coordinator_sync times
    that path on its own); a restarted sampler gets the
    trainer's current weights and trains on, the hung one comes back (its late batch is dropped), and every
    prompt drawn is trained exactly once or still owed by the final checkpoint. The weights travel as frames
    on the sync port (pipeline.weight_transport=zmq)."""
    ports = free_ports(2)
    steps = 12  # the faults come after step 3; the steps after them are where both samplers train on again
    trainer = spawn("train", "grpo", *overrides(tiny_model_dir, tmp_path, "faults", steps, ports,
                                                 "pipeline.placement=zmq", "pipeline.max_staleness=1",
                                                 "pipeline.heartbeat_timeout_s=3", "pipeline.peer_timeout_s=120",
                                                 "algorithm.rollout_is=token", "pipeline.ref_logprobs=trainer",
                                                 "pipeline.weight_transport=zmq"))
    a, b = sampler(tiny_model_dir, ports, "--sampler-id", "a"), sampler(tiny_model_dir, ports, "--sampler-id", "b")
    run = tmp_path / "faults"
    try:
        wait_for(lambda: steps_logged(run) >= 3, 240, "three trained steps")
        os.killpg(a.pid, signal.SIGKILL)
        os.killpg(b.pid, signal.SIGSTOP)
        again = sampler(tiny_model_dir, ports, "--sampler-id", "a2")
        wait_for(lambda: "a2" in samplers_logged(run), 200, "a batch of the restarted sampler trained")
        os.killpg(b.pid, signal.SIGCONT)
        out, err = trainer.communicate(timeout=400)
        assert trainer.returncode == 0, err[-3000:]
        for worker in (b, again):
            assert worker.wait(timeout=60) == 0, worker.stderr.read()[-2000:]
    finally:
        stop(trainer, a, b, *([again] if "again" in dir() else []))
    assert_each_row_once(run, steps)
    rows = [json.loads(x) for x in (run / "logs" / "metrics.jsonl").read_text().splitlines()][1:]
    last = rows[-1]
    assert max(r["pipeline/staleness"] for r in rows) <= 1
    # off-policy batches are corrected by truncated IS against the samplers' own log-probs
    stale = [r for r in rows if r["pipeline/staleness"] == 1]
    assert stale and all(0 < r["rollout/is_weight_mean"] < 10 for r in stale)
    assert "pipeline/dropped_stale" in last
    # pipeline.ref_logprobs=trainer: the samplers hold no reference, the trainer computes every row's
    assert all(r["pipeline/ref_rows_trainer"] == 16 and r["pipeline/ref_groups_sampler"] == 0 for r in rows)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_trainer_resumes_and_the_sampler_rejoins(tiny_model_dir, tmp_path):
    """The trainer is killed after a checkpoint; the sampler waits; the restarted trainer resumes from its
    checkpoint, the sampler says hello to it and gets its weights, and the logged steps train each prompt exactly
    once. (A trainer
    stopped by Ctrl-C leaves its samplers waiting the same way: test_coordinator_sync.)"""
    ports = free_ports(2)
    steps = 8
    # generous peer timeouts on both sides: on a loaded machine the restarted trainer may take over a minute to
    # answer, and a sampler that gave up before then left the new trainer waiting for batches nobody made
    args = ["train", "grpo", *overrides(tiny_model_dir, tmp_path, "restart", steps, ports, "pipeline.placement=zmq",
                                        "pipeline.max_staleness=1", "pipeline.peer_timeout_s=300",
                                        "pipeline.ref_logprobs=balance")]
    run = tmp_path / "restart"
    tracker = run / "checkpoints" / "latest_checkpointed_iteration.txt"
    trainer, worker = spawn(*args), sampler(tiny_model_dir, ports, "--peer-timeout", "300")
    try:
        wait_for(tracker.exists, 240, "the first checkpoint")
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=30)
        killed_at = int(tracker.read_text())
        assert killed_at < steps
        again = spawn(*args)
        out, err = again.communicate(timeout=600)
        assert again.returncode == 0, err[-3000:] + (worker.stderr.read()[-1000:] if worker.poll() else "")
        assert f"(step {killed_at})" in out
        assert worker.wait(timeout=60) == 0
        # the sampler met the restarted trainer as a new one: hello again (its run config, model check, dtypes)
        assert worker.stdout.read().count("a restarted trainer answers") == 1
    finally:
        stop(trainer, worker, *([again] if "again" in dir() else []))
    assert_each_row_once(run, steps)
    # pipeline.ref_logprobs=balance: the trainer computes the reference rows of whole prompt groups (n=4)
    rows = [json.loads(x) for x in (run / "logs" / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(r["pipeline/ref_rows_trainer"] in (0, 4, 8, 12, 16) for r in rows)
    # the run's staleness histogram goes on across the restart: one batch a step (it started again from 0)
    assert sum(v for k, v in rows[-1].items() if k.startswith("pipeline/staleness_")) == steps, rows[-1]


def _root_script(*args, cwd):
    env = {**os.environ, "PYTHONPATH": src_path(), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(Path(SRC).parent / args[0]), *args[1:]], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True)


# communication_test.py between two processes, every field of its sample: test_seed004_cli


# a reward with spread inside most groups, whatever the model says: the replay buffer has groups to keep
PARITY_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 2)
'''


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_seed_workers_as_written(tiny_model_dir, tmp_path):
    """sampling_worker.py + training_worker.py --no-deepspeed, from the seed's command lines, with the trainer's
    --replay-buffer-size: the trainer's replay source wraps the batches its sampler sends."""
    (tmp_path / "reward.py").write_text(PARITY_REWARD)
    ports = [str(p) for p in free_ports(2)]
    common = ["--data-port", ports[0], "--sync-port", ports[1], "--model-path", str(tiny_model_dir)]
    # 64 rows: the prompt accounting of assert_each_row_once follows the trainer's data order over that many
    trainer = _root_script("training_worker.py", "--gpu-id", "0", *common, "--no-deepspeed", "--max-steps", "2",
                           "--batch-size", "4", "--group-size", "4", "--output-dir", str(tmp_path), "--threads", "1",
                           "--replay-buffer-size", "8", "pipeline.replay_share=0.5",
                           f"algorithm.reward_fn={tmp_path}/reward.py:compute_score",
                           "data.train_size=64", "data.val_size=4", "rollout.max_new_tokens=8",
                           "trainer.progress_bar=false", cwd=tmp_path)
    out, _ = finish(trainer, _root_script("sampling_worker.py", "--gpu-id", "0", *common, "--threads", "1",
                                          cwd=tmp_path))
    run = tmp_path / "grpo_zmq"
    assert (run / "checkpoints" / "global_step_2" / "model" / "model.safetensors").is_file()
    assert len(trained_rows(run)) == 2
    assert "replay buffer:" in out
    rows = [json.loads(x) for x in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "replay/buffer_size" in r]
    assert len(steps) == 2 and steps[0]["replay/buffer_size"] >= 1 and steps[1]["replay/groups_replaced"] >= 1
    # the flag turned on the IS correction that replayed (off-policy) groups need
    assert "rollout/is_weight_mean" in steps[1]
    # a replayed group is a reuse, never a new prompt: the rows each step accounts for are the sampler's new ones,
    # each dataset row drawn trained exactly once
    assert_each_row_once(run, 2)


@pytest.mark.parametrize("argv, said", [(["--training-gpus", "a,b"], "--training-gpus 'a,b': give comma-separated"),
                                        (["--lr", "abc"], "argument --lr: invalid float value: 'abc'"),
                                        (["--bogus", "1"], "unrecognized arguments: --bogus 1")])
def test_run_distributed_names_a_bad_flag_before_starting_anything(argv, said, capsys, monkeypatch):
    """The trainer's flags too are checked by run_distributed.py itself, in its own name, before it starts
    the sampler and the trainer (no process is started: Popen would raise here)."""
    from alignrl.compat import zmq_launcher as seed004_launch

    monkeypatch.setattr(seed004_launch.subprocess, "Popen", None)
    with pytest.raises(SystemExit) as e:
        seed004_launch.launcher_main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"run_distributed.py: error: {said}"), err


def test_run_distributed_gives_host_to_both_and_stops_when_its_sampler_fails(monkeypatch):
    """--host reaches the sampler too (it connected to 127.0.0.1 while the trainer bound the address given), and a
    sampler that fails ends the run with its exit code at once (the trainer waited pipeline.peer_timeout_s)."""
    from alignrl.compat import zmq_pipeline as seed004, zmq_launcher as seed004_launch
    from alignrl.runtime.launch import wait_interruptible

    started = []

    class Done:  # a process that has already exited 0
        returncode = 0

        def __init__(self, argv, **kw):
            started.append(argv)

        def poll(self):
            return 0

        def wait(self, timeout=None):
            return 0

    with monkeypatch.context() as m:
        m.setattr(seed004_launch.subprocess, "Popen", Done)
        m.setattr(seed004, "before_start", lambda cfg, a: None)  # 10.1.2.3 is no address of this machine
        assert seed004_launch.launcher_main(["--host", "10.1.2.3", "--training-gpus", "1"]) == 0
    assert len(started) == 2 and all(a[a.index("--host") + 1] == "10.1.2.3" for a in started), started
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    sampler = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        t0 = time.monotonic()
        assert wait_interruptible(trainer, sampler, watch=(sampler,)) == 3 and time.monotonic() - t0 < 20
    finally:
        trainer.kill()
        trainer.wait()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_run_distributed_with_a_two_rank_deepspeed_trainer(tiny_model_dir, tmp_path):
    """run_distributed.py: one sampler and a 2-rank DeepSpeed ZeRO-2 trainer (on CPU the listed ids are process
    counts); rank 0 receives each batch and scatters it, and publishes the weights it holds whole. Each rank
    runs the reference forward of its share (pipeline.ref_logprobs=trainer). The deepspeed.json beside the command
    is one a user edited (its micro-batch and accumulation steps are the run's); the one written when none is there
    is test_seed004_cli's."""
    (tmp_path / "deepspeed.json").write_text(json.dumps({
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8,
        "zero_optimization": {"stage": 2}, "bf16": {"enabled": False}}))
    data, sync = (str(p) for p in free_ports(2))  # not the seed's 5555/5556: another program may hold them
    proc = _root_script("run_distributed.py", "--sampling-gpu", "0", "--training-gpus", "1,2", "--model-path",
                        str(tiny_model_dir), "--data-port", data, "--sync-port", sync, "--max-steps", "2",
                        "--batch-size", "4", "--group-size", "4",
                        "--output-dir", str(tmp_path), "data.train_size=32", "data.val_size=4",
                        "rollout.max_new_tokens=8", "trainer.progress_bar=false", "--max-staleness", "1",
                        "pipeline.ref_logprobs=trainer", cwd=tmp_path)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        stop(proc)
    assert proc.returncode == 0, (out + err)[-3000:]
    log = out + err
    assert "GRPO on 2 rank(s), strategy deepspeed" in log and "the trainer finished" in log
    assert log.count("training_worker: deepspeed.json: train_micro_batch_size_per_gpu 1") == 1, log[-3000:]
    assert "effective batch = 1 sequences/micro-batch × 2 rank(s) × 8 accumulation step(s)" in log, log[-3000:]
    assert len(trained_rows(tmp_path / "grpo_zmq")) == 2
    # each rank computed the reference rows of its own share of the groups (rank 0 logs its 2 x 4 rows)
    rows = [json.loads(x) for x in (tmp_path / "grpo_zmq" / "logs" / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["pipeline/ref_rows_trainer"] for r in rows] == [8.0, 8.0]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bad_peers_get_one_line_and_lose_nothing(tiny_model_dir, tmp_path):
    """A sampler with another model is refused in one line; a second trainer (two ranks) on the same ports
    stops in one line; garbage and a peer of another protocol version on the data port are counted and
    skipped, and so is a message of 70000 frames; a sampler pointed at a port with no trainer stops in one line;
    the run then completes with a good sampler. The trainer is DeepSpeed ZeRO-3 on two ranks, in bf16 mode under model.dtype=float32,
    so it publishes bf16 weights: the sampler loads the model in fp32 and takes the trainer's dtypes from its
    welcome (a dtype is a run setting, not another model)."""
    import msgpack
    import zmq

    from alignrl.models.tiny import TinyRecipe, build_demo_model

    other = build_demo_model(tmp_path / "other", TinyRecipe(vocab_size=300, hidden_size=48, intermediate_size=64,
                                                           num_hidden_layers=2, num_attention_heads=2,
                                                           num_key_value_heads=1, tokenizer_corpus=500, sft_steps=0),
                             log=lambda *_: None)
    # the trainer's shapes, other weights: it would score the KL term's reference log-probs with another model
    same_shapes = tmp_path / "same_shapes"
    shutil.copytree(tiny_model_dir, same_shapes)
    moved = {k: v + 0.01 for k, v in load_file(same_shapes / "model.safetensors").items()}
    save_file(moved, same_shapes / "model.safetensors", metadata={"format": "pt"})
    ports = free_ports(3)
    ds = tmp_path / "deepspeed.json"
    # ZeRO-3: the trainer's parameters are empty shards, and the model check must compare the full shapes
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}))
    # two ranks: what rank 0 alone counts (malformed messages) is logged as counted, not averaged over ranks
    trainer = spawn("train", "grpo", "--nproc", "2",
                    *overrides(tiny_model_dir, tmp_path, "bad", 2, ports, "pipeline.placement=zmq",
                               "pipeline.peer_timeout_s=120", "pipeline.heartbeat_timeout_s=3",
                               "trainer.strategy=deepspeed", f"trainer.deepspeed_config={ds}"))
    procs = [trainer]
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    try:
        # the two refused samplers start side by side
        wrong, nobody = sampler(other, ports), sampler(tiny_model_dir, [ports[0], ports[2]], "--peer-timeout", "3")
        procs += [wrong, nobody]
        _, err = wrong.communicate(timeout=120)
        assert wrong.returncode == 2 and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1 and "trainer's --model-path" in err, err
        # the trainer holds its ports and answers now: the other refused peers start side by side (each is refused
        # on its own, so none needs the one before it gone; one after another, their start-ups only added up)
        impostor = sampler(same_shapes, ports)
        # a second trainer on two ranks stops, both ranks, with rank 0's one line
        twin = spawn("train", "grpo", "--nproc", "2", *overrides(tiny_model_dir, tmp_path, "twin", 2, ports,
                                                                 "pipeline.placement=zmq"))
        # a sampler given another data file than the trainer's, as many rows (64) of other problems: one line before
        # it takes any work (it trained on the wrong text before)
        other_data = tmp_path / "other.jsonl"
        other_data.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": f"#### {i + 1}"}) + "\n"
                                      for i in range(64)))
        other = sampler(tiny_model_dir, ports, "--data-path", str(other_data))
        procs += [impostor, twin, other]
        _, err = impostor.communicate(timeout=120)
        assert impostor.returncode == 2 and len(err.strip().splitlines()) == 1, err
        assert "the trainer's parameter shapes but other weights" in err, err
        _, err = twin.communicate(timeout=120)
        assert twin.returncode == 2 and len(err.strip().splitlines()) == 1, err[-3000:]
        assert f"port {ports[0]} on 127.0.0.1 is in use" in err, err
        assert not (tmp_path / "twin" / "config.yaml").exists()  # a run that never started writes no config
        out, err = nobody.communicate(timeout=120)
        assert nobody.returncode == 2 and "no trainer answered" in err and len(err.strip().splitlines()) == 1, err
        assert f"waiting for a trainer on tcp://127.0.0.1:{ports[2]}" in out, out  # said at once, not at the end
        _, err = other.communicate(timeout=180)
        assert other.returncode == 2 and len(err.strip().splitlines()) == 1, err
        assert f"this sampler's data ({other_data}) holds other rows than the trainer's" in err, err
        push.connect(f"tcp://127.0.0.1:{ports[0]}")
        push.send_multipart([b"not msgpack at all"])
        push.send_multipart([msgpack.packb({"proto": 99, "kind": "scored_batch", "token": "", "meta": {},
                                            "tensors": []})])
        push.send_multipart([b""] * 70000)  # more frames than any message has: dropped, not the end of the run
        good = sampler(tiny_model_dir, ports)
        procs.append(good)
        out, err = trainer.communicate(timeout=300)
        assert trainer.returncode == 0, err[-3000:]
        assert "protocol 99" in out + err
    finally:
        push.close()
        ctx.term()
        stop(*procs)
    last = [json.loads(x) for x in (tmp_path / "bad" / "logs" / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["pipeline/malformed"] == 3.0
    assert len(trained_rows(tmp_path / "bad")) == 2
    assert {v.dtype for v in weights(tmp_path / "bad", 2).values()} == {torch.bfloat16}


@pytest.mark.timeout(200)
def test_a_trainer_without_samplers_stops_in_one_line(tiny_model_dir, tmp_path):
    trainer = spawn("train", "grpo", *overrides(tiny_model_dir, tmp_path, "alone", 2, free_ports(2),
                                                 "pipeline.placement=zmq", "pipeline.peer_timeout_s=3"))
    try:
        _, err = trainer.communicate(timeout=150)
    finally:
        stop(trainer)
    assert trainer.returncode == 2 and len(err.strip().splitlines()) == 1, err[-3000:]
    assert "no sampler delivered a batch for step 1 in 3 s: start one with `python sampling_worker.py" in err


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_sampler_given_the_wrong_data_port_stops_in_one_line_and_the_trainer_says_its_prompts_go_on(
        tiny_model_dir, tmp_path):
    """The trainer answers on the sync port, but nothing reads the batch where the sampler pushes it: the sampler
    says which flag is wrong and stops (it used to wait on, holding its lease for pipeline.lease_timeout_s), and the
    trainer says in one line that the lease's prompts go to the next sampler."""
    ports, wrong = free_ports(2), free_ports(1)[0]
    trainer = spawn("train", "grpo", *overrides(tiny_model_dir, tmp_path, "wrong", 2, ports, "pipeline.placement=zmq",
                                                "pipeline.heartbeat_timeout_s=2"), env={"PYTHONUNBUFFERED": "1"})
    said = []  # the trainer's lines as it prints them: the test waits for the one it needs, not a fixed time
    reader = threading.Thread(target=lambda: said.extend(trainer.stdout), daemon=True)
    reader.start()
    bad = None
    try:
        # the sampler's 3 s count from its start: it starts once the trainer answers (a loaded machine can take
        # longer than that to start the trainer, and the sampler then rightly says no trainer answered)
        wait_for(lambda: "pipeline: waiting for samplers on" in "".join(said), 150, "the trainer's sockets")
        bad = sampler(tiny_model_dir, (wrong, ports[1]), "--peer-timeout", "3")
        _, err = bad.communicate(timeout=150)
        assert bad.returncode == 2, err[-3000:]
        assert "Traceback" not in err and err.strip().splitlines()[-1] == (f"alignrl sample: nothing took the batch on tcp://127.0.0.1:{wrong} (--data-port) in "
                                 f"3 s, though a trainer answers on tcp://127.0.0.1:{ports[1]} (--sync-port): give the "
                                 "trainer's --data-port"), err[-3000:]
        # the trainer's heartbeat timeout (2 s) passes, and it says so
        wait_for(lambda: "not heard from in 2 s" in "".join(said), 60, "the trainer's line on the silent sampler")
    finally:
        stop(trainer, *([bad] if bad is not None else []))
        reader.join(timeout=30)
    out = "".join(said)
    assert "pipeline: sampler" in out and "not heard from in 2 s: its 4 prompts (lease" in out, out[-3000:]


def test_a_sampler_without_a_chat_template_serves_only_a_trainer_that_templates_nothing(monkeypatch, tmp_path):
    """The trainer's run says whether prompts are templated: a sampler whose model folder has no chat template is
    refused in one line by a templating trainer, and serves one that templates nothing."""
    from types import SimpleNamespace

    from alignrl.config import load_config
    from alignrl.models.loader import ModelError
    from alignrl.placements.zmq import sampler as S

    class Served(Exception):
        pass

    def served(*_):
        raise Served

    monkeypatch.setattr(S, "producer_prompts", served)  # past the check: the prompts of the trainer's run
    s = object.__new__(S.Sampler)
    s.tokenizer, s.args = SimpleNamespace(chat_template=None), SimpleNamespace(model_path="/models/base")
    with pytest.raises(ModelError, match=r"^model folder /models/base: the tokenizer has no chat template, and the "
                                         r"trainer's run templates its prompts; .* data.apply_chat_template=false$"):
        s._serve(load_config(None, []))
    with pytest.raises(Served):
        rows = tmp_path / "rows.jsonl"
        rows.write_text('{"prompt": "1+1=", "answer": "2"}\n')
        s._serve(load_config(None, [f"data.train_files={rows}", f"data.val_files={rows}", "data.prompt_key=prompt",
                                    "data.apply_chat_template=false"]))
