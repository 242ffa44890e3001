"""Seed 001's vision script, examples/scripts/r1_scripts/xDAN-L1-VL-RL-Vision-0220.sh: it starts the remote rule reward
(`python -m openrlhf.models.remote_rm.math_verifier`, OpenRLHF's protocol) from the repository root, submits
`alignrl train ppo-ray` with LMM-R1's flags (--train_vlm, --freeze_prefix visual, RLOO, all models colocated, the
reward at /get_reward), and stops the reward server when the job ends. With a stand-in `ray`: the flags pass the
checks and place as upstream; on a two-node CPU Ray cluster (start_ray_cluster.sh, CPU slots for GPUs): one RLOO step
of a tiny Qwen2-VL on chatml rows with images, rewarded by the server."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from alignrl.runtime.ports import free_ports
from conftest import PY_BIN, run_until_agent, src_path

ROOT = Path(__file__).parents[1]
SCRIPTS = ROOT / "examples" / "scripts" / "r1_scripts"
SCRIPT = SCRIPTS / "xDAN-L1-VL-RL-Vision-0220.sh"


@pytest.fixture(scope="module")
def vl_data(tmp_path_factory):
    """A tiny Qwen2-VL taught the task's answer format by a few SFT steps (a random one earns no reward, so a step
    would have nothing to learn from: its answers must differ) and chatml rows of its task (each question names its
    picture, so every prompt's user text is its own and the reward server finds its row by it)."""
    from dataclasses import replace

    from alignrl.demos import vision_data as D
    from alignrl.demos.vision_model import VisionRecipe, build_vision_model

    folder = tmp_path_factory.mktemp("vl")
    recipe = replace(VisionRecipe(), sft_pictures=64, count_steps=60, slip_steps=0, sft_batch_size=8)  # ~5 s
    model = build_vision_model(folder / "model", recipe, log=lambda *a: None)
    (folder / "images").mkdir()
    rows = []
    for i, p in enumerate(D.pictures(8, 7)):
        path = folder / "images" / f"{i}.png"
        D.draw(p).save(path)
        content = [{"type": "image", "image": f"file://{path}"},
                   {"type": "text", "text": f"Picture {i}: " + p.question()}]
        rows.append({"message": json.dumps([{"role": "user", "content": content}]), "answer": str(p.count)})
    data = folder / "rows.json"
    data.write_text(json.dumps(rows))
    return model, data


def answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.timeout(180)
def test_vision_script_serves_the_reward_and_submits_lmm_r1s_flags(vl_data, tmp_path):
    from alignrl.compat import openrlhf_flags as F
    from alignrl.compat import openrlhf_keys as K
    from alignrl.config import load_config
    from alignrl.placements.ray.plan import describe, requests

    model, data = vl_data
    port = free_ports(1)[0]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # a stand-in `ray` records the job's command and, while the job would run, asks the reward server
    (bin_dir / "ray").write_text(f'#!/usr/bin/env bash\nwhile [[ $1 != -- ]]; do shift; done\nshift\n'
                                 f'printf "%s\\n" "$@" > {tmp_path}/job.txt\n'
                                 f'curl -s -XPOST -H "Content-Type: application/json" -d \'{{"query": ["x"]}}\' '
                                 f'http://127.0.0.1:{port}/get_reward > {tmp_path}/reward.txt\n')
    # the dashboard probe finds a stand-in cluster; every other request goes to the real curl
    (bin_dir / "curl").write_text('#!/usr/bin/env bash\n[[ $* == */api/version* ]] && exit 0\n'
                                  'exec /usr/bin/curl "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{PY_BIN}:/usr/bin:/bin", "PRETRAIN": str(model), "DATASET": str(data),
           "SAVE_PATH": str(tmp_path / "ckpts"), "REWARD_PORT": str(port), "PYTHONPATH": src_path(),
           "OMP_NUM_THREADS": "1"}
    out = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    job = (tmp_path / "job.txt").read_text().splitlines()
    assert job[:3] == ["alignrl", "train", "ppo-ray"], job
    args = F.parser().parse_args(job[3:])
    F.check(args)
    assert args.remote_rm_url == f"http://127.0.0.1:{port}/get_reward" and args.train_vlm
    assert args.freeze_prefix == ["visual"] and args.advantage_estimator == "rloo" and args.input_key == "message"
    cfg = load_config(None, K.overrides(args, gpus=False, total_steps=1))
    assert cfg.services.reward_url == args.remote_rm_url and cfg.rollout.n == 16
    assert describe(requests(args), gpus=True).endswith("= 8 GPU"), describe(requests(args), gpus=True)
    # the server was up during the job and said why it could not score a prompt it does not know (one line)
    reward = json.loads((tmp_path / "reward.txt").read_text())
    assert "in no row of the server's --dataset" in reward["error"]["message"], reward
    assert (tmp_path / "ckpts" / "xDAN-L1-RL-VL-7B-Instruct" / "remote_rm.log").is_file()
    deadline = time.time() + 30
    while answers(port) and time.time() < deadline:  # stopped with the script
        time.sleep(0.5)
    assert not answers(port)


@pytest.mark.timeout(60)
def test_vision_script_without_cluster_is_one_line(tmp_path):
    port = free_ports(1)[0]
    env = {**os.environ, "PATH": f"{PY_BIN}:{os.environ['PATH']}", "HEAD_HOST": "127.0.0.1",
           "RAY_DASHBOARD_PORT": str(port), "DATASET": str(tmp_path / "rows.json"), "SAVE_PATH": str(tmp_path)}
    out = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=45)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stdout + out.stderr
    assert f"no Ray cluster answers at http://127.0.0.1:{port}" in out.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vision_script_trains_a_step_on_a_two_node_cpu_cluster(vl_data, tiny_model_dir, tmp_path):
    """On the two nodes start_ray_cluster.sh starts, with test_ray_scripts' checks of them and seed 003's job before
    (one cluster for both jobs: starting and stopping one is a good part of either's time)."""
    from test_ray_scripts import two_script_nodes

    model, data = vl_data
    with two_script_nodes(tiny_model_dir, tmp_path, extra=1) as nodes:  # ports[10]: the reward server's
        # no KL reference: the fewest model workers that place an actor and its engine on each node
        sizes = {"ACTOR_NUM_NODES": "2", "GPUS_PER_NODE": "1", "VLLM_NUM_ENGINES": "2", "INIT_KL_COEF": "0",
                 "N_SAMPLES": "4",
                 "ROLLOUT_BATCH_SIZE": "4", "TRAIN_BATCH_SIZE": "16", "MICRO_TRAIN_BATCH_SIZE": "4",
                 "MICRO_ROLLOUT_BATCH_SIZE": "4", "GENERATE_MAX_LEN": "16", "PROMPT_MAX_LEN": "96", "TOTAL_STEPS": "1",
                 "ZERO_STAGE": "2", "SAVE_STEPS": "1", "ACTOR_LR": "1e-4"}
        env = {**nodes.base, **sizes, "HEAD_HOST": "127.0.0.1", "PRETRAIN": str(model), "DATASET": str(data),
               "SAVE_PATH": str(tmp_path / "ckpts"), "REWARD_PORT": str(nodes.ports[10])}
        out = run_until_agent(["bash", str(SCRIPT)], env, timeout=480)
        assert out.returncode == 0 and "succeeded" in out.stdout, (out.stdout + out.stderr)[-4000:]
        run = tmp_path / "ckpts" / "xDAN-L1-RL-VL-7B-Instruct"
        saved = run / "ckpt" / "global_step_1" / "model" / "model.safetensors"
        assert saved.is_file(), (out.stdout[-3000:])
        placed = json.loads((run / "placement.json").read_text())  # ACTOR_NUM_NODES=2: one actor rank on each node
        actors = [w["node_id"] for w in placed["workers"] if w["name"].startswith("actor rank")]
        assert len(actors) == 2 and len(set(actors)) == 2, placed["workers"]
        from safetensors.torch import load_file

        before, after = load_file(str(Path(model) / "model.safetensors")), load_file(str(saved))
        visual = [k for k in before if ".visual." in f".{k}"]
        assert visual and all(torch.equal(before[k], after[k]) for k in visual)  # --freeze_prefix visual
        assert any(not torch.equal(before[k], after[k]) for k in before if k not in visual)  # the rest trained
        assert not answers(nodes.ports[10])  # the reward server stopped with the script


def test_openrlhfs_module_spelling_of_the_trainer_is_alignrls_ppo_ray():
    """`python3 -m openrlhf.cli.train_ppo_ray` (how OpenRLHF's and LMM-R1's scripts submit training), from the
    repository root, is `alignrl train ppo-ray`: the same flags, the same one-line errors."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), src_path()]), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "openrlhf.cli.train_ppo_ray", "--pretrain", "demo", "--no_such_flag"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "alignrl train ppo-ray: error: unrecognized arguments: --no_such_flag"], out.stderr[-2000:]
