"""The RL loop itself on two gloo ranks: `alignrl train grpo --nproc 2` on each training engine, and
a checkpoint written by one engine resumed by another."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_group
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# A reward that varies between samples of a random model, so advantages (and updates) are non-zero.
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 3) / 2.0
'''


def run(tiny_model_dir, tmp_path, name, strategy, steps, *extra, reward_text=REWARD):
    reward = tmp_path / "reward.py"
    reward.write_text(reward_text)
    cmd = [sys.executable, "-m", "alignrl", "train", "grpo", "--nproc", "2", f"model.path={tiny_model_dir}",
           "data.train_size=64", "data.val_size=8", "data.val_size_during_training=8", "data.train_batch_size=4",
           "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=2", "rollout.n=4", "rollout.max_new_tokens=6",
           f"trainer.total_training_steps={steps}", "trainer.test_freq=0", "trainer.save_freq=1",
           f"trainer.output_dir={tmp_path}", f"trainer.experiment_name={name}", f"trainer.strategy={strategy}",
           "trainer.progress_bar=false", f"algorithm.reward_fn={reward}:compute_score", "actor.lr=1e-3", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": "60"}
    return run_group(cmd, 240, env=env)


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


CRITIC = ("algorithm.adv_estimator=gae", "critic.enable=true")

# A moving average of the policy, moved after every optimizer step from the weights gathered from the ranks; with the
# whole batch as one mini-batch each RL step is one optimizer step (its gradient accumulated over micro-batches), so a
# checkpoint's average follows from the one before it and the policy saved beside it.
BETA = 0.9
EMA = (f"actor.ema_beta={BETA}", "actor.ppo_mini_batch_size=4")


def assert_moving_average(run_dir: Path, steps: list[int], start: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each step's ema/ is BETA of the previous average (`start` before the first) plus 1 - BETA of that step's
    saved policy; returns the last average."""
    for step in steps:
        folder = run_dir / "checkpoints" / f"global_step_{step}"
        average, policy = weights(folder / "ema"), weights(folder / "model")
        assert average.keys() == policy.keys() == start.keys()
        # the step moved the policy well past the tolerance, so a wrong beta or a missed update shows
        assert max(float((policy[k].float() - start[k].float()).abs().max()) for k in start) > 1e-4
        for k in average:
            want = BETA * start[k].float() + (1 - BETA) * policy[k].float()
            torch.testing.assert_close(average[k], want, rtol=0, atol=1e-6, msg=lambda m, k=k: f"step {step} {k}: {m}")
        start = average
    return start


# DeepSpeed from seed 000's config/deepspeed/zero3.json (trainer.zero_stage left at its default 2: the file's stage
# decides, also that generation and evaluation run on a full copy of the sharded weights)
ZERO3_FILE = f"trainer.deepspeed_config={Path(__file__).parents[1] / 'config' / 'deepspeed' / 'zero3.json'}"


# the reference moved halfway toward the policy after every update (actor.ref_sync_steps): a whole copy from DDP's
# replicas, then, resumed, sharded beside FSDP2's policy shards; sharded beside ZeRO-3's partitions, each gathered
REF_SYNC = ("actor.ref_sync_steps=1", "actor.ref_mixup_alpha=0.5", "trainer.max_checkpoints=0")


def assert_moved_reference(run_dir: Path, steps: list[int], start: dict[str, torch.Tensor]) -> None:
    """Each step's reference/ is half that step's saved policy and half the reference before it (`start` first)."""
    for step in steps:
        folder = run_dir / "checkpoints" / f"global_step_{step}"
        reference, policy = weights(folder / "reference"), weights(folder / "model")
        for k in reference:
            torch.testing.assert_close(reference[k], 0.5 * policy[k] + 0.5 * start[k], rtol=0, atol=1e-6,
                                       msg=lambda m, k=k: f"step {step} {k}: {m}")
        start = reference


@pytest.mark.parametrize("strategy,extra", [("ddp", CRITIC + REF_SYNC + EMA),
                                            ("deepspeed", (ZERO3_FILE, *EMA, *REF_SYNC))])
def test_grpo_runs_on_two_ranks(strategy, extra, tiny_model_dir, tmp_path):
    extra = (*extra, f"trainer.rollout_data_dir={tmp_path / 'rollouts'}")  # both ranks' rollouts, gathered
    r = run(tiny_model_dir, tmp_path, strategy, strategy, 2, *extra)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"on 2 rank(s), strategy {strategy}" in r.stdout
    assert r.stdout.count("base_accuracy=") == 1  # only rank 0 prints the summary
    # the KL term's reference: whole on each DDP replica, sharded over the ranks beside ZeRO-3's partitions
    where = "reference: sharded over 2 ranks (FSDP2)" if strategy == "deepspeed" else "reference: a whole copy on each"
    assert r.stdout.count(where) == 1, r.stdout[-2000:]
    run_dir = tmp_path / strategy
    rows = [json.loads(x) for x in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows if "actor/grad_norm" in x or "critic/vf_loss" in x] == [1, 2]
    dumped = [json.loads(x) for x in (tmp_path / "rollouts" / "2.jsonl").read_text().splitlines()]
    assert len(dumped) == 16 and len({d["input"] for d in dumped}) == 4  # 2 prompts x 4 answers on each rank
    ckpt = run_dir / "checkpoints" / "global_step_2"
    after, before = weights(ckpt / "model"), weights(tiny_model_dir)
    assert after.keys() == before.keys()  # the tied embedding matrix saved once, as the base model holds it
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 1e-5
    # from the base weights, over DDP's replicas or ZeRO-3's gathered partitions
    ema2 = assert_moving_average(run_dir, [1, 2], before)
    if strategy == "ddp":  # FSDP2 resumes DDP's checkpoint, the policy's and the critic's optimizer state included
        assert (ckpt / "critic" / "model.safetensors").is_file() and (ckpt / "critic_state").is_dir()
        r = run(tiny_model_dir, tmp_path, strategy, "fsdp2", 3, *extra)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "resumed from" in r.stdout and "fresh optimizer" not in r.stdout
        # FSDP2 shards the reference, and each rank reads its rows of DDP's moved reference and mixes them
        assert "reference: sharded over 2 ranks (FSDP2)" in r.stdout, r.stdout[-2000:]
        step3 = run_dir / "checkpoints" / "global_step_3"
        assert (step3 / "model_state" / "optim.pt").is_file() and (step3 / "critic_state").is_dir()
        assert weights(step3 / "model").keys() == before.keys()
        # the resumed reference (step 2's, not the base), then half of FSDP2's policy shards
        assert_moved_reference(run_dir, [3], weights(ckpt / "reference"))
        assert_moving_average(run_dir, [3], ema2)  # carried on over the resume, then from FSDP2's gathered shards
        rows = [json.loads(x) for x in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in rows if "critic/vf_loss" in x] == [1, 2, 3]
    if strategy == "deepspeed":
        assert json.loads((run_dir / "deepspeed.json").read_text())["zero_optimization"]["stage"] == 3
        assert_moved_reference(run_dir, [1, 2], before)  # each rank's rows, from each gathered ZeRO-3 weight
        # rank 1's optimizer shard damaged in place (same size: the manifest passes it): rank 1 names the file
        (shard,) = (ckpt / "model_state" / "deepspeed").glob("zero_pp_rank_1_*optim_states.pt")
        good = shard.read_bytes()
        shard.write_bytes(bytes(200) + good[200:])
        r = run(tiny_model_dir, tmp_path, strategy, strategy, 3, *extra)
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert f"rank 1: cannot read {shard} (" in r.stderr and f"move {ckpt} out of" in r.stderr, r.stderr[-3000:]
        shard.write_bytes(good)
        # DeepSpeed's optimizer shards are its own format: DDP continues from the full weights, and says so
        r = run(tiny_model_dir, tmp_path, strategy, "ddp", 3, *REF_SYNC)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "resumed from" in r.stdout and "fresh optimizer" in r.stdout
        assert (run_dir / "checkpoints" / "global_step_3" / "model_state" / "optim.pt").is_file()


@pytest.mark.timeout(300)
def test_a_bf16_fsdp2_trainer_feeds_a_zmq_sampler(tiny_model_dir, tmp_path):
    """FSDP2 keeps a bf16 model's shards in fp32 for the optimizer: the sampler is told the bf16 dtypes the
    trainer publishes (it was refused with "tensor ... is bfloat16, the served model needs float32"), and the
    checkpoint holds bf16 weights under a config that says so. The trainer scores the reference rows
    (pipeline.ref_logprobs=trainer) with a reference sharded over its two ranks."""
    from alignrl.runtime.ports import free_ports
    from zmqpipeline import finish, overrides, sampler, spawn

    ports = free_ports(2)
    trainer = spawn("train", "grpo", "--nproc", "2", *overrides(
        tiny_model_dir, tmp_path, "f", 2, ports, "pipeline.placement=zmq", "pipeline.peer_timeout_s=120",
        "trainer.strategy=fsdp2", "model.dtype=bfloat16", "trainer.save_freq=2", "pipeline.ref_logprobs=trainer"))
    out, _ = finish(trainer, sampler(tiny_model_dir, ports), timeout=240)
    assert out.count("reference: sharded over 2 ranks (FSDP2)") == 1, out[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "f" / "logs" / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["pipeline/ref_rows_trainer"] for r in rows] == [8.0, 8.0]  # rank 0's 2 groups x 4 answers
    model = tmp_path / "f" / "checkpoints" / "global_step_2" / "model"
    assert {v.dtype for v in weights(model).values()} == {torch.bfloat16}
    assert json.loads((model / "config.json").read_text())["dtype"] == "bfloat16"


# Rank 1's groups never differ (every answer scores 1) while rank 0's do: rank 0 fills its share at once, rank 1
# stays short through every refill round.
SPLIT_REWARD = '''
import os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if os.environ.get("RANK") == "1" else float(len(solution_str) % 2)
'''


def test_dynamic_sampling_on_two_ranks_refills_together_and_trains_the_fewest_groups(tiny_model_dir, tmp_path):
    """Every rank draws as many refill rounds as the shortest needs (rank 0, already full, draws and discards, so the
    ranks' samplers stay in step) and trains as many groups as the rank that kept fewest: with rank 1's groups all
    equal, none, so no rank updates and none waits for the other's gradients (a rank updating alone would hang the
    run). With rewards that differ on both ranks, each fills its share and both train."""
    dapo = ("algorithm.dynamic_sampling=true", "algorithm.max_gen_rounds=2")
    r = run(tiny_model_dir, tmp_path, "split", "ddp", 2, *dapo, reward_text=SPLIT_REWARD)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "split" / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in rows if "dapo/kept_groups" in x]
    assert [x["step"] for x in steps] == [1, 2], rows
    assert all(x["dapo/kept_groups"] == 0 and x["dapo/gen_rounds"] == 3 for x in steps), steps
    assert not any("actor/grad_norm" in x for x in rows)
    assert "kept 0 of 2 groups per rank after 3 generation round(s)" in r.stdout + r.stderr
    r = run(tiny_model_dir, tmp_path, "both", "ddp", 1, *dapo, "algorithm.dynamic_sampling_range=[0,1]",
            reward_text=SPLIT_REWARD.replace('1.0 if os.environ.get("RANK") == "1" else ', ""))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "both" / "logs" / "metrics.jsonl").read_text().splitlines()]
    (step,) = [x for x in rows if "dapo/kept_groups" in x]
    assert step["dapo/kept_groups"] == 4 and "actor/grad_norm" in step, step
