"""OpenRLHF's flags of `alignrl train ppo-ray`: their checks (one line each), their translation into
config keys, and the placement groups they ask for. No Ray cluster needed."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from alignrl.compat import openrlhf_keys as K
from alignrl.compat import openrlhf_flags as F
from alignrl.placements.ray.plan import GroupLayout, describe, requests
from alignrl.config import load_config
from alignrl.runtime.ports import free_port

SEED_001 = ["--ref_num_nodes", "2", "--ref_num_gpus_per_node", "4", "--actor_num_nodes", "2",
            "--actor_num_gpus_per_node", "4", "--vllm_num_engines", "2", "--vllm_tensor_parallel_size", "4",
            "--colocate_actor_ref", "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "8",
            "--rollout_batch_size", "128", "--train_batch_size", "128", "--micro_train_batch_size", "2",
            "--use_kl_loss", "--init_kl_coef", "0.001"]


def parse(*argv):
    return F.parser().parse_args(list(argv))


def test_openrlhfs_optimiser_defaults_and_settings_come_with_its_flags():
    """OpenRLHF's scheduler (warm-up over 3% of the optimizer steps, rounded up, then cosine to 0.1 × lr), Adam betas
    (0.9, 0.95), GAE lambda 0.95, value clip 0.2 and reward clamp (-10, 10), for actor and critic alike; its other
    optimiser and PPO flags map to their keys."""
    cfg = load_config(None, K.overrides(parse(*SEED_001), gpus=False, total_steps=5))
    steps = 5 * (128 * 8 // 128)  # RL steps × optimizer steps of one (one epoch)
    for part in (cfg.actor, cfg.critic):
        assert (part.lr_scheduler, part.min_lr_ratio, part.betas) == ("cosine", 0.1, [0.9, 0.95])
        assert part.lr_warmup_steps == math.ceil(steps * 0.03) == 2 and part.weight_decay == 0.0
    a = cfg.algorithm
    assert (a.lam, cfg.critic.cliprange_value, a.reward_clip, a.kl_ctrl_type) == (0.95, 0.2, [-10.0, 10.0], "fixed")
    given = parse(*SEED_001, "--lr_warmup_ratio", "0.5", "--adam_betas", "0.8", "0.9", "--l2", "0.1", "--max_norm",
                  "0.5", "--eps_clip", "0.3", "--value_clip", "0.4", "--lambd", "0.9", "--kl_target", "0.05",
                  "--use_kl_estimator_k3", "--reward_clip_range", "-1", "2", "--freezing_actor_steps", "2",
                  "--dual_clip", "3", "--wandb_project", "p", "--eval_steps", "4", "--lr_scheduler", "constant")
    cfg = load_config(None, K.overrides(given, gpus=False, total_steps=5))
    assert (cfg.actor.lr_scheduler, cfg.actor.lr_warmup_steps, cfg.actor.betas) == ("constant", 0, [0.8, 0.9])
    assert (cfg.critic.weight_decay, cfg.critic.grad_clip, cfg.actor.clip_ratio_high, cfg.actor.clip_ratio_c) == \
        (0.1, 0.5, 0.3, 3.0)
    a = cfg.algorithm
    assert (a.lam, cfg.critic.cliprange_value, a.reward_clip, a.kl_ctrl_type, a.kl_target) == \
        (0.9, 0.4, [-1.0, 2.0], "adaptive", 0.05)
    assert (cfg.actor.kl_loss_type, cfg.critic.warmup_steps, cfg.trainer.project_name, cfg.trainer.test_freq) == \
        ("k3", 2, "p", 4)
    tb = load_config(None, K.overrides(parse(*SEED_001, "--use_tensorboard", "/tb", "--save_path", "/c/run"),
                                       gpus=False, total_steps=5))
    assert tb.trainer.tensorboard_dir == "/tb/run" and "tensorboard" in tb.trainer.logger  # OpenRLHF: PATH/<run>
    with_warmup = K.overrides(parse(*SEED_001, "--lr_scheduler", "constant_with_warmup"), gpus=False, total_steps=5)
    assert load_config(None, with_warmup).actor.lr_warmup_steps == 2


def test_openrlhf_flags_that_do_nothing_here_are_named_and_the_unsupported_ones_refused():
    args = parse(*SEED_001, "--normalize_reward", "--save_hf_ckpt", "--wandb_run_name", "r", "--logging_steps", "5")
    said = K.unused_here(args, gpus=True)
    assert any(line.startswith("--normalize_reward (not applied here: it normalizes a reward model") for line in said)
    rm = parse(*SEED_001, "--normalize_reward", "--reward_pretrain", "/models/rm")
    assert not any("--normalize_reward" in line for line in K.unused_here(rm, gpus=True))  # applied: below
    assert "algorithm.reward_model_normalize=true" in K.overrides(rm, gpus=False, total_steps=5)
    assert any(line.startswith("--save_hf_ckpt (") for line in said) and any("--wandb_run_name" in x for x in said)
    assert any(line.startswith("--logging_steps (") for line in said), said
    with pytest.raises(F.FlagError, match="4-bit") as e:
        F.check(parse(*SEED_001, "--load_in_4bit"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("argv, words", [
    (["--advantage_estimator", "rloo", "--n_samples_per_prompt", "1"], "--n_samples_per_prompt > 1"),
    (["--actor_num_gpus_per_node", "3", "--train_batch_size", "8", "--micro_train_batch_size", "2"],
     "multiple of --micro_train_batch_size"),
    (["--colocate_actor_ref", "--ref_num_gpus_per_node", "4"], "colocating actor and ref"),
    (["--colocate_all_models", "--vllm_num_engines", "3"], "--colocate_all_models"),
    (["--actor_num_gpus_per_node", "2", "--micro_train_batch_size", "1", "--train_batch_size", "8",
      "--rollout_batch_size", "7"], "multiple of --train_batch_size"),
    (["--reward_pretrain", "rm", "--remote_rm_url", "http://x"], "not both"),
    (["--prompt_data", "p.json", "--input_key", "messages"], "without --label_key the prompts have no answer"),
    (["--actor_num_gpus_per_node", "2", "--micro_train_batch_size", "1", "--critic_num_gpus_per_node", "3"],
     "must be a multiple of the critic's (3, --critic_num_nodes × --critic_num_gpus_per_node, 8 by default)"),
])
def test_openrlhf_checks_are_one_line(argv, words):
    with pytest.raises(F.FlagError) as e:
        F.check(parse(*argv))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_seed_001_flags_translate_to_the_loop_config():
    args = parse(*SEED_001, "--pretrain", "demo", "--flash_attn", "--bf16", "--gradient_checkpointing")
    F.check(args)
    cfg = load_config(None, K.overrides(args, gpus=False, total_steps=3))
    assert (cfg.data.train_batch_size, cfg.rollout.n, cfg.actor.ppo_mini_batch_size) == (128, 8, 16)
    a = cfg.algorithm  # OpenRLHF's group_norm: the outcome normalised in its group, not whitened again
    assert (a.adv_estimator, a.outcome_baseline, a.whiten_advantages) == ("reinforce_plus_plus", "mean_std", "none")
    assert cfg.actor.use_kl_loss and cfg.actor.kl_loss_coef == 0.001
    assert not cfg.algorithm.use_kl_in_reward and not cfg.critic.enable and cfg.trainer.device == "cpu"
    assert cfg.actor.gradient_checkpointing  # applied on any device
    not_applied = f"--flash_attn ({K.RESIDENT_WHY})"  # said on GPUs too, not dropped in silence
    assert K.unused_here(args, gpus=False) == [not_applied, "--bf16 (no CUDA)"]
    assert K.unused_here(args, gpus=True) == [not_applied]
    # --zero_stage 3 shards the reference group on any device; below 3, or with no reference, it does nothing on CPUs
    assert K.unused_here(parse(*SEED_001, "--zero_stage", "3"), gpus=False) == []
    assert K.unused_here(parse(*SEED_001, "--zero_stage", "1"), gpus=False) == ["--zero_stage (no CUDA)"]
    assert GroupLayout.from_flags(parse(*SEED_001, "--zero_stage", "3")).shard_ref
    assert not GroupLayout.from_flags(parse(*SEED_001)).shard_ref
    gpu = load_config(None, K.overrides(args, gpus=True, total_steps=3))
    assert (gpu.trainer.strategy, gpu.model.dtype) == ("deepspeed", "bfloat16")


@pytest.mark.parametrize("estimator, extra, want", [
    ("gae", [], ("gae", "none", "std")), ("gae", ["--no_advantage_std_norm"], ("gae", "none", "center")),
    ("reinforce", [], ("reinforce_plus_plus", "none", "std")), ("rloo", [], ("reinforce_plus_plus", "loo", "none")),
    ("reinforce_baseline", [], ("reinforce_plus_plus", "mean", "std")),
    ("reinforce_baseline", ["--no_advantage_std_norm"], ("reinforce_plus_plus", "mean", "center")),
    ("group_norm", ["--no_advantage_std_norm"], ("reinforce_plus_plus", "mean_std", "none")),
    ("dr_grpo", [], ("reinforce_plus_plus", "mean", "none")),
])
def test_openrlhf_estimators_keep_their_shaping_and_whitening(estimator, extra, want):
    """OpenRLHF shapes the outcome with the group, then KL per token and returns-to-go, then whitens (gae,
    reinforce, reinforce_baseline only): REINFORCE++ with an outcome baseline (core.advantages checks the numbers).
    Its group estimators run with gamma 1 whatever --gamma says, and say so once."""
    args = parse("--advantage_estimator", estimator, "--n_samples_per_prompt", "4", "--gamma", "0.9", *extra)
    F.check(args)
    a = load_config(None, K.overrides(args, gpus=False, total_steps=3)).algorithm
    assert (a.adv_estimator, a.outcome_baseline, a.whiten_advantages) == want
    group = estimator in F.GROUP_ESTIMATORS
    assert a.gamma == (1.0 if group else 0.9)
    assert any(line.startswith("--gamma (OpenRLHF sets gamma to 1") for line in K.unused_here(args, False)) == group


def test_estimators_drop_the_critic_and_zero_kl_drops_the_reference():
    ppo = parse("--init_kl_coef", "0", "--reward_pretrain", "rm", "--colocate_critic_reward")
    reqs = requests(ppo)
    assert list(reqs) == ["actor", "critic", "engine0"] and reqs["critic"].roles == ["critic", "reward"]
    assert list(requests(parse("--advantage_estimator", "rloo", "--n_samples_per_prompt", "2"))) == \
        ["actor", "ref", "engine0"]


def test_seed_001_placement_groups():
    reqs = requests(parse(*SEED_001))
    assert {k: (r.nodes, r.per_node, r.roles) for k, r in reqs.items()} == {
        "actor": (2, 4, ["actor", "ref"]), "engine0": (1, 4, ["engine0"]), "engine1": (1, 4, ["engine1"])}
    assert describe(reqs, gpus=True).endswith("= 16 GPU")
    colocated = requests(parse(*SEED_001, "--colocate_all_models"))
    assert list(colocated) == ["actor"] and colocated["actor"].roles == ["actor", "ref", "engine0", "engine1"]


def test_command_line_errors_are_one_line():
    out = subprocess.run([sys.executable, "-m", "alignrl", "train", "ppo-ray", "--advantage_estimator", "rloo"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
    assert "--n_samples_per_prompt > 1" in out.stderr


def test_input_errors_name_the_flags_not_the_config_keys(tmp_path, capsys, monkeypatch):
    """Bad data and model folders are found by the driver before Ray starts, and said in ppo-ray's own flags."""
    import functools

    from alignrl.compat.openrlhf_ppo_ray import main
    from alignrl.rollout import service_health

    monkeypatch.setattr(service_health, "check_services", functools.partial(service_health.check_services, wait_s=0))

    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"q": "1+1", "a": "2"}\n')
    dead = f"http://127.0.0.1:{free_port()}"  # found before placement: it was found by the first rollout
    cases = [(["--pretrain", str(tmp_path)], f"--pretrain '{tmp_path}' is not a Hugging Face model folder (no "
              "config.json there); pass a local folder saved with save_pretrained, or --pretrain demo"),
             (["--prompt_data", str(tmp_path / "none.jsonl")], f"data file not found: {tmp_path / 'none.jsonl'} "
              "(set --prompt_data to an existing .jsonl, .json or .parquet file)"),
             (["--prompt_data", str(odd)], "for other columns set --input_key <prompt column> and --label_key "
              "<answer column>)"),
             (["--advantage_estimator", "gae", "--critic_pretrain", str(tmp_path)], f"--critic_pretrain '{tmp_path}' "
              "is not a Hugging Face model folder"),
             (["--actor_learning_rate", "nan"], "--actor_learning_rate nan must be a finite number"),
             (["--eps_clip", "-1"], "--eps_clip -1.0 is out of range"),
             (["--eval_dataset", str(tmp_path / "none.jsonl")], "(set --eval_dataset to an existing"),
             (["--remote_rm_url", dead], f"reward service at {dead} is not reachable after 3 tries")]
    for argv, said in cases:
        assert main(["--pretrain", "demo", "--total_steps", "1", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("alignrl train ppo-ray: error: ") and said in err, err


@pytest.mark.parametrize("script", ["xDAN-L2-RL-32b-Instruct-0220-nodes.sh", "xDAN-L1-Edge-7b-Math-RL-0220.sh"])
def test_seed_001_training_scripts_pass_the_checks(script, tmp_path):
    """The scripts' `ray job submit -- alignrl train ppo-ray ...` (caught by a stand-in `ray`) give the
    seed's placement and pass OpenRLHF's checks on the demo model."""
    fake = tmp_path / "ray"
    fake.write_text('#!/usr/bin/env bash\nwhile [[ $1 != -- ]]; do shift; done\nshift 4\n'
                    f'printf "%s\\n" "$@" > {tmp_path}/args.txt\n')
    fake.chmod(0o755)
    probe = tmp_path / "curl"  # the script asks the dashboard first: a stand-in cluster answers
    probe.write_text("#!/usr/bin/env bash\nexit 0\n")
    probe.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "PRETRAIN": "demo", "PROMPT_DATA": "synthetic",
           "SAVE_PATH": str(tmp_path / "run"), "HOME": str(tmp_path)}
    path = Path(__file__).parents[1] / "examples" / "scripts" / "r1_scripts" / script
    out = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    args = parse(*(tmp_path / "args.txt").read_text().splitlines())
    F.check(args)
    load_config(None, K.overrides(args, gpus=False, total_steps=3))
    assert describe(requests(args), gpus=True) == ("actor 2 node(s) × 4 GPU (with ref); engine0 1 node(s) × 4 GPU; "
                                                   "engine1 1 node(s) × 4 GPU = 16 GPU")


def test_verl_hybrid_layout_puts_actor_engine_and_reference_in_every_unit():
    """trainer.nnodes × trainer.n_gpus_per_node as verl's hybrid engine: one placement group of the actor's
    units, an engine of TP 1 per rank, the reference colocated (only when a KL term needs it)."""
    reqs = requests(GroupLayout.hybrid(2, 4, reference=True))
    assert {k: (r.nodes, r.per_node, r.roles) for k, r in reqs.items()} == {
        "actor": (2, 4, ["actor", "ref"] + [f"engine{e}" for e in range(8)])}
    assert describe(reqs, gpus=False) == ("actor 2 node(s) × 4 CPU (with ref, engine0, engine1, engine2, engine3, "
                                          "engine4, engine5, engine6, engine7) = 8 CPU")
    assert list(requests(GroupLayout.hybrid(1, 1, reference=False))["actor"].roles) == ["actor", "engine0"]


def test_reward_model_group_honours_colocate_critic_reward():
    flags = ["--reward_pretrain", "rm", "--reward_num_nodes", "2", "--reward_num_gpus_per_node", "1",
             "--critic_num_nodes", "2", "--critic_num_gpus_per_node", "1"]
    assert requests(parse(*flags))["reward"].roles == ["reward"]
    assert "reward" not in requests(parse(*flags, "--colocate_critic_reward"))
    assert requests(parse(*flags, "--colocate_critic_reward"))["critic"].roles == ["critic", "reward"]


def test_a_config_that_places_its_own_producers_is_refused_inside_a_ray_job(monkeypatch, capsys):
    from alignrl.cli import main

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # never reached: refused before connecting
    assert main(["train", "ppo", "pipeline.placement=zmq", "trainer.nnodes=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pipeline.placement=zmq" in err and "unset RAY_ADDRESS" in err, err


def test_a_ray_address_nobody_answers_at_is_one_line_at_once():
    """ray.init waits minutes on a dead address, printing only its GCS client's retries, and answers a dashboard
    URL with a traceback: both are named before it is called."""
    import socket

    from alignrl.placements.ray.driver import address_problem

    dead = free_port()
    assert f"no Ray cluster answers at RAY_ADDRESS=127.0.0.1:{dead}" in address_problem(f"127.0.0.1:{dead}")
    assert "`ray start --head --port=" in address_problem(f"ray://127.0.0.1:{dead}")
    assert "is the dashboard's (job submission) address" in address_problem("http://127.0.0.1:8265")
    assert "is not host:port" in address_problem("127.0.0.1")
    assert address_problem("auto") is None
    with socket.socket() as up:  # something listens: left to ray.init
        up.bind(("127.0.0.1", 0))
        up.listen()
        assert address_problem(f"127.0.0.1:{up.getsockname()[1]}") is None


@pytest.mark.timeout(120)
def test_ppo_ray_with_a_dead_ray_address_stops_in_one_line(tmp_path):
    from conftest import src_path

    env = {**os.environ, "PYTHONPATH": src_path(), "RAY_ADDRESS": f"127.0.0.1:{free_port()}", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "alignrl", "train", "ppo-ray", "--pretrain", "demo",
                          "--save_path", str(tmp_path / "run")], capture_output=True, text=True, timeout=100,
                         env=env, cwd=tmp_path)
    err = out.stderr.strip()
    assert out.returncode == 1 and err.count("\n") == 0 and "Traceback" not in err, err[-3000:]
    assert "no Ray cluster answers at RAY_ADDRESS=127.0.0.1:" in err, err


def test_prompt_data_flags_become_the_data_keys(tmp_path):
    """OpenRLHF's --input_key/--label_key/--input_template/--apply_chat_template read a --prompt_data file
    by column; seed 001's flags on its {messages, answer} rows load and count."""
    import json

    from alignrl.compat.openrlhf_ppo_ray import training_steps

    data = tmp_path / "prompts.json"
    data.write_text(json.dumps([{"messages": [{"role": "user", "content": f"{i} + 1?"}], "answer": i + 1}
                                for i in range(4)]))
    args = parse(*SEED_001, "--prompt_data", str(data), "--input_key", "messages", "--label_key", "answer",
                 "--apply_chat_template", "--rollout_batch_size", "2", "--train_batch_size", "16",
                 "--micro_train_batch_size", "2", "--actor_num_gpus_per_node", "1", "--ref_num_gpus_per_node", "1",
                 "--vllm_num_engines", "1", "--micro_rollout_batch_size", "2")
    F.check(args)
    d = load_config(None, K.overrides(args, gpus=False, total_steps=3)).data
    assert (d.prompt_key, d.label_key, d.input_template, d.apply_chat_template) == ("messages", "answer", None, True)
    assert K.unused_here(args, gpus=True) == []
    assert load_config(None, K.overrides(args, gpus=False, total_steps=3)).actor.forward_micro_batch == 2
    assert not load_config(None, K.overrides(args, gpus=False, total_steps=3)).actor.use_remove_padding
    packed = parse(*SEED_001, "--packing_samples")
    assert load_config(None, K.overrides(packed, gpus=False, total_steps=3)).critic.use_remove_padding
    assert "--packing_samples" not in " ".join(K.unused_here(packed, gpus=False))  # it runs on the CPU too
    assert training_steps(args) == 2  # 4 rows / 2 prompts per step

    raw = parse("--prompt_data", str(data), "--label_key", "answer", "--input_template", "Q: {}\nA: ")
    d = load_config(None, K.overrides(raw, gpus=False, total_steps=3)).data
    assert (d.prompt_key, d.label_key, d.input_template, d.apply_chat_template) == ("input", "answer", "Q: {}\nA: ",
                                                                                      False)
    assert K.unused_here(raw, gpus=True) == []
    both = parse("--prompt_data", str(data), "--input_key", "messages", "--input_template", "Q: {}",
                 "--apply_chat_template", "--remote_rm_url", "http://127.0.0.1:1")  # the template is ignored
    F.check(both)  # no --label_key: the reward model scores
    assert load_config(None, K.overrides(both, gpus=False, total_steps=3)).data.input_template is None
    assert K.unused_here(both, gpus=True) == ["--input_template (--apply_chat_template formats the prompts)"]


def test_prompt_data_flags_leave_detected_layouts_and_synthetic_data_alone():
    detected = load_config(None, K.overrides(parse("--prompt_data", "gsm8k.jsonl", "--apply_chat_template"),
                                             gpus=False, total_steps=3)).data
    assert (detected.prompt_key, detected.apply_chat_template) == (None, True)
    synthetic = parse("--input_key", "messages", "--label_key", "answer", "--apply_chat_template")
    assert load_config(None, K.overrides(synthetic, gpus=False, total_steps=3)).data.prompt_key is None
    assert K.unused_here(synthetic, gpus=True) == ["--input_key --label_key --apply_chat_template (the prompts are "
                                                    "synthetic)"]


def test_split_flags_pick_a_hub_datasets_split_and_change_nothing_for_files(tmp_path):
    """--prompt_split and --eval_split (OpenRLHF's default for both: train) name the split of a Hub dataset or
    dataset folder (alignrl.data.sources reads `name[split]`); without --eval_dataset the evaluation reads the
    training prompts' split; on .jsonl files they are named as not applied."""
    hub = parse("--prompt_data", "owner/prompts", "--prompt_split", "dev", "--eval_dataset", "owner/held",
                "--input_key", "q", "--label_key", "a")
    d = load_config(None, K.overrides(hub, gpus=False, total_steps=3)).data
    assert (d.train_files, d.val_files) == ("owner/prompts[dev]", "owner/held[train]")
    assert K.unused_here(hub, gpus=True) == []
    alone = load_config(None, K.overrides(parse("--prompt_data", f"{tmp_path},owner/b", "--input_key", "q"),
                                          gpus=False, total_steps=3)).data
    assert list(alone.train_files) == [str(tmp_path), "owner/b"]  # train: what a dataset gives unasked
    assert list(alone.val_files) == [f"{tmp_path}[train]", "owner/b[train]"]
    files = parse("--prompt_data", "a.jsonl", "--prompt_split", "dev", "--eval_dataset", "b.jsonl", "--eval_split",
                  "test")
    assert load_config(None, K.overrides(files, gpus=False, total_steps=3)).data.train_files == "a.jsonl"
    assert K.unused_here(files, gpus=True) == ["--prompt_split --eval_split (not applied here: .jsonl/.json/.parquet "
                                               "files are read whole (a split picks one of a dataset folder or Hub "
                                               "dataset))"]
    alone = parse("--prompt_data", "owner/p", "--eval_split", "test", "--input_key", "q")
    assert K.unused_here(alone, gpus=True) == ["--eval_split (not applied here: without --eval_dataset the evaluation "
                                               "reads --prompt_data's --prompt_split)"]
    assert K.unused_here(parse("--prompt_split", "dev"), gpus=True) == ["--prompt_split (the prompts are synthetic)"]


def test_without_ray_address_a_running_cluster_of_this_machine_is_joined(monkeypatch):
    """`ray start --head` on this machine, then `alignrl train ppo-ray` without RAY_ADDRESS: Ray finds that cluster
    and refuses the resource counts of a local start with a ValueError traceback; OpenRLHF's bare ray.init()
    joins it, and so does the driver now."""
    import ray

    from alignrl.placements.ray import driver

    calls = []

    def init(**kw):
        calls.append(kw)
        if "num_cpus" in kw:
            raise ValueError("When connecting to an existing cluster, num_cpus and num_gpus must not be provided.")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    assert driver.connect(4) is False  # joined, not started: the driver must not shut it down
    assert "num_cpus" in calls[0] and "num_cpus" not in calls[1]
    monkeypatch.setattr(ray, "init", lambda **kw: (_ for _ in ()).throw(ValueError("something else")))
    with pytest.raises(ValueError, match="something else"):
        driver.connect(4)


def test_max_samples_takes_the_first_rows_of_a_prompt_file(tmp_path):
    """OpenRLHF keeps `range(min(max_samples, len(dataset)))` of --prompt_data: the loop reads those rows and
    no others, and counts its steps from them."""
    import json

    from alignrl.data.prompts import load_task_data
    from alignrl.compat.openrlhf_ppo_ray import training_steps

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(6)))
    args = parse("--prompt_data", str(data), "--label_key", "answer", "--max_samples", "4",
                 "--rollout_batch_size", "2", "--train_batch_size", "2", "--micro_train_batch_size", "2")
    train, _ = load_task_data(load_config(None, K.overrides(args, gpus=False, total_steps=3)))
    assert [s.ground_truth for s in train] == ["1", "2", "3", "4"]
    assert training_steps(args) == 2  # 4 prompts / 2 per step
    every = parse("--prompt_data", str(data), "--label_key", "answer", "--max_samples", "100")
    assert len(load_task_data(load_config(None, K.overrides(every, gpus=False, total_steps=3)))[0]) == 6
    with pytest.raises(F.FlagError, match="--max_samples 0 leaves no prompts"):
        F.check(parse("--max_samples", "0"))


def test_load_checkpoint_with_nothing_to_load_says_so(tmp_path, capsys):
    """A mistyped --ckpt_path trained from step 0 without a word; a folder with a checkpoint says nothing extra."""
    from alignrl.compat.openrlhf_ppo_ray import job
    from alignrl.train.checkpoint import write_manifest

    args = parse("--load_checkpoint", "--ckpt_path", str(tmp_path / "nock"), "--save_path", str(tmp_path / "run"),
                 "--total_steps", "4")
    F.check(args)
    job(args)
    assert f"--load_checkpoint: no checkpoint in {tmp_path / 'nock'} yet; starting from step 0" in capsys.readouterr().out
    step = tmp_path / "nock" / "global_step_2"
    step.mkdir(parents=True)
    torch.save({"step": 2}, step / "trainer_state.pt")
    write_manifest(step)
    job(args)
    assert "no checkpoint" not in capsys.readouterr().out
