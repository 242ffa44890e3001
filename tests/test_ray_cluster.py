"""The Ray placement on a two-node cluster on this machine (`ray.cluster_utils.Cluster`, two nodes × 8
fake GPUs as in seed 001, bound to 127.0.0.1, shut down by the module fixture): seed 001's placement
read back from Ray's placement tables, the Ray loop against the in-process loop, an impossible
placement, and a killed worker."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")
from ray.util.placement_group import placement_group_table  # noqa: E402

from alignrl.runner import train_grpo  # noqa: E402
from alignrl.compat import openrlhf_keys as K  # noqa: E402
from alignrl.compat import openrlhf_flags as F  # noqa: E402
from alignrl.placements.ray.plan import engine_slot, release, requests, reserve, slots  # noqa: E402
from alignrl.compat.openrlhf_ppo_ray import main  # noqa: E402
from alignrl.config import load_config  # noqa: E402
from conftest import signal_after, src_path
from raycluster import (SEED_001, all_gpus_free, gpus_free_become, metric_rows, own_lines, reward_model, seed_001_data,
                        tiny)


def test_seed_001_placement_from_rays_tables(cluster):
    assert all_gpus_free()
    args = F.parser().parse_args(SEED_001)
    F.check(args)
    reqs = requests(args)
    reserve(reqs, gpus=True, timeout_s=20)
    try:
        tables = {k: placement_group_table(r.pg) for k, r in reqs.items()}
        actor = tables["actor"]  # actor and reference share it: 4 + 4 one-GPU bundles on the two nodes
        assert actor["state"] == "CREATED" and [b["GPU"] for b in actor["bundles"].values()] == [1.0] * 8
        on = list(actor["bundles_to_node_id"].values())
        assert len(set(on)) == 2 and sorted(on.count(n) for n in set(on)) == [4, 4]
        engines = [tables["engine0"], tables["engine1"]]  # two engines of TP 4, the rest of each node:
        for t in engines:  # four one-GPU bundles each (one per vLLM tensor-parallel worker), all on one node
            assert [b["GPU"] for b in t["bundles"].values()] == [1.0] * 4 and t["strategy"] == "STRICT_PACK"
            assert len(set(t["bundles_to_node_id"].values())) == 1
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        used = {n: 0.0 for n in nodes}
        for t in tables.values():
            for i, node in t["bundles_to_node_id"].items():
                used[node] += t["bundles"][i]["GPU"]
        assert sorted(used.values()) == [8.0, 8.0]
        assert gpus_free_become(0.0), ray.available_resources()
        assert reqs["actor"].roles == ["actor", "ref"] and (reqs["actor"].share("actor"), reqs["actor"].share("ref")) == (0.75, 0.25)
    finally:
        release(reqs)


def test_colocate_all_models_puts_one_engine_on_each_node(cluster):
    assert all_gpus_free()
    args = F.parser().parse_args(SEED_001 + ["--colocate_all_models"])
    F.check(args)
    reqs = requests(args)
    reserve(reqs, gpus=True, timeout_s=20)
    try:
        assert list(reqs) == ["actor"] and reqs["actor"].roles == ["actor", "ref", "engine0", "engine1"]
        engines = [engine_slot(reqs, e, 4) for e in range(2)]
        assert len({s.node for s in engines}) == 2 and [s.local_rank for s in engines] == [0, 0]
        actors = slots(reqs, "actor", 8, 4)
        assert [s.local_rank for s in actors] == [0, 1, 2, 3] * 2 and len({s.node for s in actors}) == 2
        assert [s.node for s in actors[:4]] == [engines[0].node] * 4
    finally:
        release(reqs)


@pytest.mark.parametrize("flags", [["--colocate_actor_ref"], ["--colocate_all_models", "--vllm_tensor_parallel_size", "1",
                                                             "--vllm_num_engines", "8"]])
def test_colocated_ranks_share_one_gpu_each_and_every_worker_starts(cluster, flags):
    """Workers started as the driver starts them (references, then engines, then actor ranks), each
    reporting the GPU Ray gave it. Ray chose the GPU of a fractional worker inside a node-sized bundle,
    and its best fit put four reference ranks on one GPU: the fourth actor rank was never scheduled."""
    from alignrl.placements.ray.driver import Driver, Job
    from alignrl.placements.ray.plan import GroupLayout
    from alignrl.config import RunConfig

    class GpuProbe:  # defined here, so Ray ships it by value (the workers cannot import this test module)
        def __init__(self, name: str):
            self.name = name

        def gpus(self) -> tuple[str, str, list]:
            return self.name, ray.get_runtime_context().get_node_id(), ray.get_gpu_ids()

    assert all_gpus_free()
    args = F.parser().parse_args(SEED_001 + flags)
    F.check(args)
    layout = GroupLayout.from_flags(args)
    driver = Driver(Job(layout, RunConfig(), "test"))
    driver.gpus, driver.reqs = True, requests(layout)
    reserve(driver.reqs, gpus=True, timeout_s=20)
    try:
        peers = [driver.start(GpuProbe, s, f"ref{i}", f"ref{i}") for i, s in enumerate(slots(driver.reqs, "ref", 8, 4))]
        peers += [driver.start(GpuProbe, engine_slot(driver.reqs, e, layout.tp), f"engine{e}", f"engine{e}")
                  for e in range(layout.engines)]
        peers += [driver.start(GpuProbe, s, f"actor{i}", f"actor{i}")
                  for i, s in enumerate(slots(driver.reqs, "actor", 8, 4))]
        ready, pending = ray.wait([p.handle.gpus.remote() for p in peers], num_returns=len(peers), timeout=60)
        assert not pending, f"{len(pending)} of {len(peers)} workers were never scheduled"
        where = {name: (node, tuple(ids)) for name, node, ids in ray.get(ready)}
        actors = [where[f"actor{i}"] for i in range(8)]
        assert len(set(actors)) == 8 and all(len(ids) == 1 for _, ids in actors)  # a GPU of its own each
        assert [n for n, _ in actors[:4]] == [actors[0][0]] * 4  # ranks 0-3 on one node, 4-7 on the other
        shared = {f"ref{i}": i for i in range(8)}
        if layout.colocate_all_models:  # engine e on its first unit's GPU
            shared |= {f"engine{e}": e * layout.tp for e in range(layout.engines)}
        for name, rank in shared.items():  # rank i of every colocated role on actor rank i's GPU
            assert where[name] == actors[rank], (name, where[name], actors)
    finally:
        for p in driver.workers:
            ray.kill(p.handle, no_restart=True)
        release(driver.reqs)


def test_an_impossible_placement_fails_at_once(cluster, capsys):
    assert all_gpus_free()
    t0 = time.monotonic()
    code = main(SEED_001 + ["--actor_num_gpus_per_node", "12", "--ref_num_gpus_per_node", "12",
                                 "--train_batch_size", "192", "--rollout_batch_size", "24", "--total_steps", "1"])
    err = "\n".join(own_lines(capsys.readouterr().err))
    assert code == 2 and time.monotonic() - t0 < 45  # before --placement_timeout's default 60 s
    assert err.count("\n") == 0 and "actor 2 node(s) × 12 GPU" in err and "2 node(s) with 8, 8 GPU" in err, err


def test_a_placement_that_is_never_granted_fails_after_its_timeout(cluster, capsys):
    """Each group fits alone, the sum fits the free GPUs, but 6 + 6 actor GPUs leave no node with 4 for
    the engine: the wait ends after --placement_timeout with one line."""
    assert all_gpus_free()
    t0 = time.monotonic()
    code = main(["--actor_num_nodes", "2", "--actor_num_gpus_per_node", "6", "--vllm_num_engines", "1",
                 "--vllm_tensor_parallel_size", "4", "--init_kl_coef", "0", "--advantage_estimator", "group_norm",
                 "--n_samples_per_prompt", "2", "--micro_train_batch_size", "1", "--train_batch_size", "24",
                 "--rollout_batch_size", "12", "--total_steps", "1", "--placement_timeout", "3"])
    err = "\n".join(own_lines(capsys.readouterr().err))
    assert code == 2 and time.monotonic() - t0 < 60 and err.count("\n") == 0, err
    assert "engine0 (1 node(s) × 4 GPU) was not granted in 3 s" in err and "16 GPU" in err, err
    assert all_gpus_free()  # nothing left reserved


@pytest.mark.timeout(400)
def test_ray_steps_with_critic_and_reward_groups_match_the_in_process_loop_after_a_resume(cluster, tiny_model_dir,
                                                                                         tmp_path, capsys):
    """PPO (`--advantage_estimator gae`) with the critic and the reward model each in a group of their own, the
    prompts read from a .json file by seed 001's `--input_key messages --label_key answer --apply_chat_template`,
    one engine (the in-process rows and seeds), two DDP actor ranks against one process, one optimizer step per
    RL step (the mini-batch shuffle is per rank).
    Steps 1-2: two critic ranks (DDP among them; actor rank r -> critic rank r) and the reward model on 2 nodes
    × 1 (each worker scores half the rows); the critic ranks write `critic/` and `critic_state/` into the run's
    checkpoint. Then a rerun with `--load_checkpoint` to step 3 with one critic rank serving both actor ranks
    (their rows trained in one update), resumed from those folders, and one reward model rank. The policy and
    the critic equal an uninterrupted 3-step in-process run. atol 2e-5: the all-reduce's float order moves
    weights by ~1e-6 here (measured: 2.0e-6 policy, 2.0e-7 critic after Adam's three steps), while a step moves
    them by ~1e-3 (lr 1e-3), so any other batch, reward or a missed update fails it."""
    ckpt, rm = tmp_path / "ckpt", reward_model(tiny_model_dir, tmp_path / "rm")
    argv = tiny(tiny_model_dir, tmp_path / "ray", 2, "--train_batch_size", "16", "--ckpt_path", str(ckpt),
                "--advantage_estimator", "gae", "--critic_pretrain", str(tiny_model_dir), "--critic_num_nodes", "1",
                "--critic_learning_rate", "1e-3", "--reward_pretrain", str(rm), "--reward_num_nodes", "2",
                "--reward_num_gpus_per_node", "1", *seed_001_data(tmp_path / "prompts.json"),
                "--lr_scheduler", "constant")  # a cosine's length would change with --total_steps at the resume
    assert main(argv + ["--critic_num_gpus_per_node", "2"]) == 0, capsys.readouterr().err
    placed = json.loads((tmp_path / "ray" / "placement.json").read_text())
    critics = [w for w in placed["workers"] if w["name"].startswith("critic rank")]
    assert [w["group"] for w in critics] == ["critic", "critic"], placed["workers"]
    rms = [w for w in placed["workers"] if w["name"].startswith("reward model rank")]
    assert len({w["node_id"] for w in rms}) == 2 and {w["group"] for w in rms} == {"reward"}, rms
    step2 = ckpt / "global_step_2"
    assert (step2 / "critic" / "model.safetensors").exists() and (step2 / "critic_state").is_dir()
    before = metric_rows(tmp_path / "ray")
    # the last --total_steps wins; one reward rank scores every row (the two ranks' split was steps 1-2's, and a row's
    # score is its own): a worker start fewer
    assert main(argv + ["--critic_num_gpus_per_node", "1", "--reward_num_nodes", "1", "--total_steps", "3",
                        "--load_checkpoint"]) == 0, capsys.readouterr().err
    after = metric_rows(tmp_path / "ray")  # steps 0..2 kept as they were (a fresh start would rewrite them)
    assert after[:len(before)] == before and [r["step"] for r in after[len(before):]] == [3], after
    rows = [r for r in after if r["step"] > 0]  # step 0: the base evaluation
    assert [r["step"] for r in rows] == [1, 2, 3] and all("critic/values_mean" in r for r in rows), rows
    args = F.parser().parse_args(argv)
    inline_summary = train_grpo(load_config(None, K.overrides(args, gpus=False, total_steps=3) + [
        f"trainer.output_dir={tmp_path}", "trainer.experiment_name=inline3", "trainer.checkpoint_dir=checkpoints"]))
    ray_summary = json.loads((tmp_path / "ray" / "summary.json").read_text())  # evaluated on the rollout engine
    for key in ("base_accuracy", "final_accuracy"):
        assert ray_summary[key] == inline_summary[key], (ray_summary, inline_summary)
    inline = tmp_path / "inline3" / "checkpoints" / "global_step_3"
    worst = {}
    for part in ("model", "critic"):
        a, b = (load_file(root / part / "model.safetensors") for root in (ckpt / "global_step_3", inline))
        base = load_file(step2 / part / "model.safetensors")
        assert any(not torch.equal(base[k], a[k]) for k in a), f"the rerun did not train the {part} at step 3"
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=2e-5, msg=f"{part}: {k}")
        worst[part] = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"max |ray - in-process| at step 3 after the resume: {worst}")


def verl_args(model_dir, steps: int) -> list[str]:
    """Seed 003's `python3 -m verl.trainer.main_ppo` arguments (PPO with GAE, KL in the reward, a critic,
    verl's checkpoint folder) on two nodes × one unit, shrunk to the tiny model and 4 prompts a step."""
    return ["train", "ppo", "data.train_batch_size=4", "data.val_data_num=4", "data.max_prompt_length=64",
            "data.max_response_length=8", "data.shuffle_train_dataloader=True", "algorithm.adv_estimator=gae",
            f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size=2",
            "actor_rollout_ref.rollout.n_agent=1", "actor_rollout_ref.rollout.temperature=1",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.name=vllm",
            "critic.optim.lr=1e-3", f"critic.model.path={model_dir}", "critic.ppo_micro_batch_size=2",
            "algorithm.kl_ctrl.kl_coef=0.001", "trainer.critic_warmup=0", "trainer.logger=['console','jsonl']",
            "trainer.n_gpus_per_node=1", "trainer.nnodes=2", "trainer.save_freq=1", "trainer.test_freq=0",
            "trainer.project_name=ray-job", "trainer.experiment_name=ppo-2x1", f"trainer.total_training_steps={steps}",
            "trainer.default_local_dir=verl_checkpoints/ppo-2x1", "trainer.threads=1", "trainer.progress_bar=false"]


@pytest.mark.timeout(300)
def test_a_verl_run_inside_a_ray_job_is_placed_on_both_nodes(cluster, tiny_model_dir, tmp_path, monkeypatch, capsys,
                                                             retrieval_stub):
    """`alignrl train ppo <seed 003's arguments>` with RAY_ADDRESS set (as inside `ray job submit`): two
    actor ranks (trainer.nnodes=2 × n_gpus_per_node=1), each with its rollout engine and reference worker
    in its unit, one per node as Ray's placement table says; checkpoints and logs where trainer.* puts
    them (relative to the job's working directory). The engines make Search-R1's multi-turn rollouts
    (max_turns; each engine's search tool asks the retrieval endpoint once, when its first batch is made).
    Resuming in Ray (trainer.resume_mode=auto, verl's default, is what --load_checkpoint sets) is
    test_ray_steps_with_critic_and_reward_groups_...'s (above)."""
    from alignrl.cli import main as cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    assert all_gpus_free()
    turns = ["max_turns=2", f"retriever.url={retrieval_stub}"]
    assert cli(verl_args(tiny_model_dir, 2) + turns) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "actor 2 node(s) × 1 GPU (with ref, engine0, engine1) = 2 GPU" in out, out[-3000:]
    run = tmp_path / "output" / "ppo-2x1"
    placed = json.loads((run / "placement.json").read_text())
    table = placed["groups"]["actor"]
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert set(table["bundles_to_node_id"].values()) == alive and len(table["bundles"]) == 2
    assert table["roles"] == ["actor", "ref", "engine0", "engine1"]
    by_name = {w["name"]: w for w in placed["workers"]}
    for role in ("actor rank", "reference rank", "rollout engine"):
        nodes = [by_name[f"{role} {i}"]["node_id"] for i in range(2)]
        assert set(nodes) == alive, (role, nodes)  # one of each on each node
        assert all(table["bundles_to_node_id"][str(by_name[f"{role} {i}"]["bundle"])] == nodes[i] for i in range(2))
    ckpt = tmp_path / "verl_checkpoints" / "ppo-2x1"
    for step in (1, 2):
        assert (ckpt / f"global_step_{step}" / "model" / "model.safetensors").is_file()
        assert (ckpt / f"global_step_{step}" / "critic").is_dir()
    # verl's default strategy (fsdp): actor and critic sharded over the two ranks
    assert torch.load(ckpt / "global_step_2" / "trainer_state.pt", weights_only=False)["strategy"] == "fsdp2"
    rows = metric_rows(run)
    assert [r["step"] for r in rows if "timing/step" in r] == [1, 2]
    assert all("agent/turns" in r for r in rows if "timing/step" in r)  # the multi-turn rollout made them
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    assert all_gpus_free()


def test_a_verl_run_asking_for_more_nodes_than_the_cluster_has_fails_at_once(cluster, tiny_model_dir, tmp_path,
                                                                              monkeypatch, capsys):
    from alignrl.cli import main as cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    assert all_gpus_free()
    t0 = time.monotonic()
    argv = [a.replace("trainer.nnodes=2", "trainer.nnodes=4") for a in verl_args(tiny_model_dir, 1)]
    assert cli(argv) == 2 and time.monotonic() - t0 < 45
    err = own_lines(capsys.readouterr().err)[-1]
    assert err.startswith("alignrl train ppo: error: placement asked for actor 4 node(s) × 1 GPU") and \
        "the cluster has 2 node(s)" in err, err


@pytest.mark.timeout(300)
def test_a_users_mistake_inside_ray_is_one_line(cluster, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """What a worker would meet is the user's to fix, and said in one line (exit 2), not a worker's traceback
    wrapped in Ray's: a malformed data file, a model folder that is none and a causal LM as the reward model,
    checked by the driver before any worker starts. (What a worker raises later: test_a_workers_user_error_...)"""
    from alignrl.cli import main as cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    bad_data = tmp_path / "bad.jsonl"
    bad_data.write_text('{"foo": "1+1", "bar": "2"}\n')  # valid JSON lines, columns of no known format
    cases = [([f"data.train_files={bad_data}"], "cannot tell the data format from columns ['bar', 'foo']"),
             ([f"actor_rollout_ref.model.path={tmp_path}"], "is not a Hugging Face model folder"),
             ([f"algorithm.reward_model={tiny_model_dir}"], "is not a reward/cost model: it has no scoring head")]
    for extra, said in cases:
        assert cli(verl_args(tiny_model_dir, 1) + extra) == 2
        err = own_lines(capsys.readouterr().err)
        assert "Traceback" not in "\n".join(err) and said in err[-1], err[-20:]
        assert err[-1].startswith("alignrl train ppo: error:"), err[-1]
    # a checkpoint past the last step: said by the driver before any worker starts (it was a worker's error, with
    # Ray's traceback of the failed call after it, tens of seconds in)
    from alignrl.train.checkpoint import write_manifest

    done = tmp_path / "verl_checkpoints" / "ppo-2x1" / "global_step_5"
    done.mkdir(parents=True)
    torch.save({"step": 5}, done / "trainer_state.pt")
    write_manifest(done)
    t0 = time.time()
    assert cli(verl_args(tiny_model_dir, 1)) == 2
    err = own_lines(capsys.readouterr().err)
    assert len(err) == 1 and "is past trainer.total_training_steps=1" in err[0], err[-20:]
    assert time.time() - t0 < 20, "checked after the workers started"
    assert all_gpus_free()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_rollout_engine_ends_the_run_with_one_line(cluster, tiny_model_dir, tmp_path):
    """kill -9 of the engine: the driver stops within 30 s, naming the role and node."""
    env = {**os.environ, "PYTHONPATH": src_path(), "RAY_ADDRESS": cluster.address, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "alignrl", "train", "ppo-ray",
                          *tiny(tiny_model_dir, tmp_path / "kill", 500, "--init_kl_coef", "0",
                                "--actor_num_gpus_per_node", "1")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        pid = None
        for line in p.stdout:
            if "workers up:" in line:
                pid = int(line.split("rollout engine 0 on node")[1].split("(pid ")[1].split(")")[0])
            if pid and "step 1 " in line:
                break
        assert pid, "the driver never reported its workers"
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
    print(f"driver stopped {took:.1f} s after kill -9 of the engine")
    # the driver's one line; Ray may still forward a worker's last log lines after it
    errors = [x for x in err.splitlines() if x.startswith("alignrl train ppo-ray: error:")]
    assert p.returncode == 1 and took < 30, (took, err[-2000:])
    assert len(errors) == 1 and "rollout engine 0 on node 127.0.0.1" in errors[0] and "died" in errors[0], err[-2000:]


def test_a_long_generation_is_waited_for_while_its_engine_lives(cluster):
    """A step's generation may take longer than the peer timeout (a big model and batch): the actor ranks wait
    for it, with a line every period naming the engine still at work (before, 120 s without an answer ended the
    run); an engine that dies meanwhile is one ClusterError line."""
    from alignrl.placements.ray.channel import ClusterError, Peer, patient_get

    @ray.remote(num_cpus=0)
    class Slow:
        def work(self, seconds: float) -> str:
            time.sleep(seconds)
            return "batch"

    lines = []
    engine = Peer(Slow.remote(), "rollout engine 0")
    assert patient_get([engine.handle.work.remote(2.5)], [engine], 1.0, lines.append) == ["batch"]
    assert lines[:2] == ["rollout engine 0 still at work after 1 s", "rollout engine 0 still at work after 2 s"]
    ref = engine.handle.work.remote(60)
    time.sleep(0.5)
    ray.kill(engine.handle)
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match="rollout engine 0 died"):
        patient_get([ref], [engine], 1.0, lines.append)
    assert time.monotonic() - t0 < 20


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_of_the_driver_stops_the_run_as_ctrl_c(cluster, tiny_model_dir, tmp_path):
    """kill (and `ray job stop`, which sends SIGTERM): the workers are released and one line says how to continue;
    Ray's own handler dumped a stack trace and aborted (exit 134)."""
    env = {**os.environ, "PYTHONPATH": src_path(), "RAY_ADDRESS": cluster.address, "OMP_NUM_THREADS": "1"}
    code, _, err = signal_after([sys.executable, "-m", "alignrl", "train", "ppo-ray",
                                 *tiny(tiny_model_dir, tmp_path / "term", 500, "--init_kl_coef", "0",
                                       "--actor_num_gpus_per_node", "1")], "step 1 ", signal.SIGTERM, "stdout",
                                env=env)
    said = [x for x in err.splitlines() if x.startswith("alignrl train ppo-ray:")]
    assert code == 130 and "SIGTERM received" not in err, err[-2000:]
    assert len(said) == 1 and "interrupted; the same command with --load_checkpoint continues" in said[0], err[-2000:]


@pytest.mark.timeout(300)
def test_dynamic_filtering_refills_over_two_actor_ranks(cluster, tiny_model_dir, tmp_path, capsys):
    """OpenRLHF's --dynamic_filtering on two actor ranks: the engine filters its share, the ranks draw the same
    extra rounds (they hold the same merged batch and sampler), and each trains an equal share of the groups kept.
    The reward file (OpenRLHF's reward_func) scores a query by its length's parity, so some groups differ."""
    reward = tmp_path / "reward_func.py"
    reward.write_text("import torch\n\ndef reward_func(queries, prompts, labels):\n"
                      "    return torch.tensor([float(len(q) % 2) for q in queries])\n")
    argv = tiny(tiny_model_dir, tmp_path / "dapo", 2, "--dynamic_filtering", "--remote_rm_url", str(reward),
                "--init_kl_coef", "0")
    assert main(argv) == 0, capsys.readouterr().err
    rows = [r for r in metric_rows(tmp_path / "dapo") if "dapo/kept_groups" in r]
    assert [r["step"] for r in rows] == [1, 2], rows
    for r in rows:  # 4 prompts a step: 2 groups for each rank when full, an even count when a refill falls short
        # OpenRLHF's refill: until full, at most one pass over the 64 prompts in draws of 4 (16 rounds)
        assert r["dapo/kept_groups"] in (0.0, 2.0, 4.0) and 1 <= r["dapo/gen_rounds"] <= 16, r
    assert any(r["dapo/kept_groups"] > 0 and "actor/grad_norm" in r for r in rows), rows
    assert all_gpus_free()


@pytest.mark.timeout(300)
def test_an_agent_function_plays_episodes_on_the_ray_rollout_engine(cluster, tiny_model_dir, tmp_path, capsys):
    """OpenRLHF's --agent_func_path on the Ray placement: the rollout engine's process loads the file (written as
    OpenRLHF's examples are, importing openrlhf.utils.agent), plays up to two turns per episode, and the episodes'
    rewards (the answer's length parity, so groups differ) train both actor ranks."""
    env = tmp_path / "agent_func.py"
    env.write_text("import torch\nfrom openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor\n\n\n"
                   "class AgentInstance(AgentInstanceBase):\n"
                   "    def __init__(self, *args, **kwargs):\n        self.turn = 0\n\n"
                   "    async def step(self, states, **kwargs):\n        self.turn += 1\n"
                   "        done = self.turn == 2\n"
                   "        return {'rewards': torch.tensor(float(len(states['action_text']) % 2)), 'done': done,\n"
                   "                'environment_feedback': '' if done else ' again:',\n"
                   "                'extra_logs': {'turn': self.turn}}"
                   "\n\n\nclass AgentExecutor(MultiTurnAgentExecutor):\n    def __init__(self):\n"
                   "        super().__init__(AgentInstance)\n")
    argv = tiny(tiny_model_dir, tmp_path / "env", 2, "--agent_func_path", str(env), "--generate_max_len", "24")
    assert main(argv) == 0, capsys.readouterr().err
    rows = [r for r in metric_rows(tmp_path / "env") if "agent/turns" in r]
    assert [r["step"] for r in rows] == [1, 2], rows
    for r in rows:  # a turn may use the whole 24 tokens (one turn) or stop early (a second after the feedback)
        assert 1.0 <= r["agent/turns"] <= 2.0 and r["agent/turn"] == r["agent/turns"], r
        assert r["agent/generated_token_frac"] <= 1.0 and "actor/grad_norm" in r, r
    assert all_gpus_free()
