"""Seed 003's Search-R1 command line runs as `alignrl train ppo <its arguments>`: verl key spellings,
GPU-only keys listed once, unknown keys rejected, list-form data files, data_source checked before any
model loads, wandb offline, and the whole argument list end to end against a local retrieval server."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from alignrl.config import ConfigError, load_config
from alignrl.config.counts import requested_world_size

REPO = Path(__file__).resolve().parents[1]

# Everything after `python3 -m verl.trainer.main_ppo` in seed 003's multinode script, verbatim.
SEED_003_ARGS = r"""
    data.train_files=$DATA_DIR/train.parquet \
    data.val_files=$DATA_DIR/test.parquet \
    data.train_data_num=null \
    data.val_data_num=null \
    data.train_batch_size=512 \
    data.val_batch_size=256 \
    data.max_prompt_length=4096 \
    data.max_response_length=500 \
    data.max_start_length=2048 \
    data.max_obs_length=500 \
    data.shuffle_train_dataloader=True \
    algorithm.adv_estimator=gae \
    actor_rollout_ref.model.path=$BASE_MODEL \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.enable_gradient_checkpointing=true \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.285 \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size=64 \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.grad_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size=128 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.ref.log_prob_micro_batch_size=128 \
    actor_rollout_ref.ref.fsdp_config.param_offload=False \
    actor_rollout_ref.rollout.n_agent=1 \
    actor_rollout_ref.rollout.temperature=1 \
    actor_rollout_ref.rollout.top_p=1.0 \
    actor_rollout_ref.actor.state_masking=true \
    critic.optim.lr=1e-5 \
    critic.model.use_remove_padding=True \
    critic.optim.lr_warmup_steps_ratio=0.015 \
    critic.model.path=$BASE_MODEL \
    critic.model.enable_gradient_checkpointing=true \
    critic.ppo_micro_batch_size=16 \
    critic.model.fsdp_config.param_offload=False \
    critic.model.fsdp_config.grad_offload=False \
    critic.model.fsdp_config.optimizer_offload=False \
    algorithm.kl_ctrl.kl_coef=0.001 \
    algorithm.no_think_rl=false \
    trainer.critic_warmup=0 \
    trainer.logger=['wandb'] \
    +trainer.val_only=false \
    +trainer.val_before_train=false \
    trainer.default_hdfs_dir=null \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=$N_NODES \
    trainer.save_freq=100 \
    trainer.test_freq=100 \
    trainer.project_name=$WAND_PROJECT \
    trainer.experiment_name=$EXPERIMENT_NAME \
    trainer.total_epochs=15 \
    trainer.total_training_steps=1005 \
    trainer.default_hdfs_dir=null \
    trainer.default_local_dir=verl_checkpoints/$EXPERIMENT_NAME \
    max_turns=4 \
    retriever.url="http://127.0.0.1:8000/retrieve" \
    retriever.topk=3 \
"""


def seed_args(**env: str) -> list[str]:
    """The argument list as the shell gives it to the program: variables expanded, quotes removed."""
    text = re.sub(r"\$(\w+)", lambda m: env[m.group(1)], SEED_003_ARGS.replace("\\\n", " "))
    return shlex.split(text)


SEED_ENV = dict(DATA_DIR="data/nq_search", BASE_MODEL="demo", N_NODES="2", WAND_PROJECT="Search-R1-release",
                EXPERIMENT_NAME="nq-search-r1-ppo")
PROMPT = ("Answer the given question. You must conduct reasoning inside <think> and </think> first every time you "
          "get new information. After reasoning, if you find you lack some knowledge, you can call a search engine "
          "by <search> query </search> and it will return the top searched results between <information> and "
          "</information>. If you find no further external knowledge needed, you can directly provide the answer "
          "inside <answer> and </answer>. Question: {q}\n")
FACTS = [("Who invented the quantum spoon?", "Zorblat Quince"), ("Where is Mount Vellor?", "Ostravia"),
         ("What colour is a glimfish?", "teal"), ("Who founded Brindle Harbor?", "Ada Merrow")]


def write_search_r1_split(path: Path, split: str, data_source: str = "nq") -> None:
    """Rows in the layout of Search-R1's scripts/data_process/nq_search.py."""
    rows = [{"data_source": data_source, "prompt": [{"role": "user", "content": PROMPT.format(q=q)}],
             "ability": "fact-reasoning", "reward_model": {"style": "rule", "ground_truth": {"target": [a]}},
             "extra_info": {"split": split, "index": i}} for i, (q, a) in enumerate(FACTS)]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.fixture(autouse=True)
def _list_again(monkeypatch):
    monkeypatch.delenv("ALIGNRL_VERL_KEYS_LISTED", raising=False)  # each test sees the one-time listing


def test_seed_003_keys_map_onto_alignrl(capsys, tmp_path):
    for split in ("train", "test"):  # 4 rows each: fewer than one batch of 512, so epochs do not bound the steps
        write_search_r1_split(tmp_path / f"{split}.parquet", split)
    args = seed_args(**dict(SEED_ENV, DATA_DIR=str(tmp_path)))
    cfg = load_config(None, args)
    assert (cfg.model.path, cfg.critic.model_path, cfg.actor.lr, cfg.critic.lr) == ("demo", "demo", 1e-6, 1e-5)
    assert (cfg.rollout.n, cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens) == (1, 1.0, 1.0, 500)
    assert (cfg.agent.max_turns, cfg.retriever.url, cfg.retriever.topk) == (4, "http://127.0.0.1:8000/retrieve", 3)
    assert (cfg.data.max_start_length, cfg.data.max_obs_length, cfg.data.shuffle) == (2048, 500, True)
    assert cfg.actor.state_masking and cfg.critic.enable and cfg.critic.warmup_steps == 0
    assert (cfg.trainer.project_name, cfg.trainer.logger, requested_world_size(cfg)) == ("Search-R1-release", ["wandb"], 16)
    assert cfg.trainer.checkpoint_dir == os.path.abspath("verl_checkpoints/nq-search-r1-ppo")
    assert cfg.trainer.max_checkpoints == 0  # Search-R1's verl keeps every checkpoint (save_freq=100 of 1005 steps)
    # verl's KL: in the reward (k1, coefficient 0.001) because use_kl_loss is off; entropy bonus 0.001
    assert (cfg.actor.use_kl_loss, cfg.algorithm.use_kl_in_reward, cfg.algorithm.kl_coef) == (False, True, 0.001)
    assert cfg.actor.entropy_coeff == 0.001
    assert cfg.actor.use_remove_padding and cfg.critic.use_remove_padding  # packed forwards run here too
    assert cfg.actor.gradient_checkpointing  # the critic's own flag is listed as not used
    assert cfg.actor.ppo_micro_batch_size == 64 // 16  # verl's deprecated global micro-batch, split over the ranks
    assert cfg.trainer.strategy == "fsdp"  # verl's default: actor and critic sharded over the 16 ranks
    # 15 epochs of max(1, 4 // 512) batches bound the 1005 steps, as in verl's loop over epochs;
    # warm-up: int(0.285 × 15) RL steps, each of 512/256 optimizer steps
    assert cfg.trainer.total_training_steps == 15
    assert (cfg.actor.lr_warmup_steps, cfg.critic.lr_warmup_steps) == (4 * 2, 0)
    out = capsys.readouterr().err
    listed = [line for line in out.splitlines() if "not used on this device" in line]
    assert len(listed) == 1, out
    for key in ("actor_rollout_ref.actor.fsdp_config.param_offload", "actor_rollout_ref.rollout.gpu_memory_utilization",
                "actor_rollout_ref.rollout.name",
                "trainer.default_hdfs_dir", "critic.ppo_micro_batch_size"):
        assert key in listed[0]
    assert listed[0].count("trainer.default_hdfs_dir") == 1  # given twice, listed once
    load_config(None, args)
    assert "not used" not in capsys.readouterr().err  # once per launch, not once per config load


def test_unknown_and_unsupported_keys_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"unknown config key 'actor_rollout_ref.actor.optim.lrr' \(did you mean "
                                          r"'actor_rollout_ref.actor.optim.lr'\?\)") as e:
        load_config(None, ["actor_rollout_ref.actor.optim.lrr=1e-6"])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="unknown config key 'trainer.no_such_key'"):
        load_config(None, ["+trainer.no_such_key=1"])
    with pytest.raises(ConfigError, match=r"trainer.val_only=true is not supported"):
        load_config(None, ["+trainer.val_only=true"])
    with pytest.raises(ConfigError, match="data.train_files=.* must be a file path or a list"):
        load_config(None, ["data.train_files=[]"])


def test_verls_qwen3_gsm8k_batch_splits_as_verl_splits_it_and_a_ref_sync_is_applied(capsys, monkeypatch):
    """examples/grpo_trainer/run_qwen3-1.7b.sh: 1024 prompts × 3 in mini-batches of 80 × 3 (verl asserts only that
    the batch holds one mini-batch; its last one is smaller) with verl's micro-batch of 10 a GPU;
    run_qwen2-7b_sync_ref_model.sh: the reference sync is applied (actor.ref_sync_steps)."""
    monkeypatch.delenv("ALIGNRL_VERL_KEYS_LISTED", raising=False)
    cfg = load_config(None, ["algorithm.adv_estimator=grpo", "data.train_batch_size=1024",
                             "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_mini_batch_size=80",
                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=10", "trainer.n_gpus_per_node=8"])
    assert (cfg.mini_batch_sequences, cfg.mini_batches_per_step) == (240, 13)  # 12 × 240 + 192
    capsys.readouterr()
    monkeypatch.delenv("ALIGNRL_VERL_KEYS_LISTED")  # listed once per launch: this is another
    sync = ["actor_rollout_ref.ref.sync_ref_model=True", "actor_rollout_ref.ref.ref_model_sync_steps=128",
            "actor_rollout_ref.ref.ref_model_mixup_alpha=0.9"]
    cfg = load_config(None, sync + ["actor_rollout_ref.actor.use_kl_loss=True"])  # applied: actor.ref_sync_steps
    assert (cfg.actor.ref_sync_steps, cfg.actor.ref_mixup_alpha) == (128, 0.9)
    assert "sync_ref_model" not in capsys.readouterr().err
    with pytest.raises(ConfigError, match="actor.ref_sync_steps=128 moves the reference, which this run never reads"):
        load_config(None, sync)  # verl 0.7 reads no reference without a KL term


@pytest.mark.parametrize("given, key, expect", [
    (["actor_rollout_ref.actor.optim.clip_grad=0.5"], "actor.grad_clip", 0.5),  # the engine workers' spelling
    (["critic.optim.clip_grad=2.0"], "critic.grad_clip", 2.0),
    (["data.val_max_samples=7"], "data.val_size", 7),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=cispo"], "actor.policy_loss", "cispo"),
    (["reward_model.reward_manager=prime"], "algorithm.reward_fn", None),  # naive's scores, in a process pool
    # the newest verl's reward section, its legacy keys' new home
    (["reward.custom_reward_function.path=my_reward.py", "reward.reward_manager.name=naive", "reward.num_workers=8",
      "reward.reward_model.rollout.name=vllm"], "algorithm.reward_fn", "my_reward.py:compute_score"),
    # memory, engines, dumps and Hydra's folder: accepted, listed as not used
    (["reward_model.model.use_remove_padding=True", "reward_model.rollout.name=vllm", "hydra.run.dir=outputs",
      "actor_rollout_ref.rollout.quantization.weight_dtype=fp8", "+trainer.dump_high_diff_tokens=True"],
     "trainer.strategy", "fsdp"),
    # current verl's names of rollout correction's switches, at their off values
    (["algorithm.rollout_correction.bypass_mode=False", "algorithm.rollout_correction.loss_type=ppo_clip",
      "algorithm.rollout_correction.use_policy_gradient=False"], "algorithm.rollout_is", "none"),
    (["reward.sandbox_fusion.url=http://127.0.0.1:8080/run_code"], "sandbox.url", "http://127.0.0.1:8080/run_code"),
    (["reward_model.sandbox_fusion.url=null"], "sandbox.url", ""),
    (["reward_model.sandbox_fusion_url=http://h:8080"], "sandbox.url", "http://h:8080"),
    (["reward_model.sandbox_fusion.max_concurrent=8"], "sandbox.max_concurrent", 8),
])
def test_current_verl_spellings_map_or_are_accepted(given, key, expect):
    cfg = load_config(None, ["algorithm.adv_estimator=grpo", *given])
    section, name = key.split(".")
    assert getattr(getattr(cfg, section), name) == expect


def test_current_verl_features_alignrl_lacks_are_named_or_one_line(capsys, monkeypatch):
    monkeypatch.delenv("ALIGNRL_VERL_KEYS_LISTED", raising=False)
    bypass = load_config(None, ["algorithm.rollout_correction.bypass_mode=True"])  # applied: the rollout's log-probs
    assert not bypass.actor.recompute_old_logprobs and "bypass" not in capsys.readouterr().err  # as the old policy's
    monkeypatch.delenv("ALIGNRL_VERL_KEYS_LISTED", raising=False)
    load_config(None, ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=4"])
    assert "not applied: Ulysses sequence parallelism" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="unknown config key 'reward.no_such_key': not a verl"):
        load_config(None, ["reward.no_such_key=1"])
    with pytest.raises(ConfigError, match="custom_chat_template=.* is not supported .save the template with the "
                                          "model's tokenizer"):
        load_config(None, ["actor_rollout_ref.model.custom_chat_template={{ messages }}"])


def test_grpo_with_n_agent_and_alignrl_keys_beside_verl_ones(tmp_path):
    cfg = load_config(None, ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n_agent=5",
                             "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.use_kl_loss=true",
                             "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "data.train_batch_size=10",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=5", "actor.ppo_micro_batch_size=5"])
    assert (cfg.rollout.n, cfg.critic.enable, cfg.actor.kl_loss_type) == (5, False, "low_var_kl")
    assert cfg.actor.use_kl_loss and not cfg.algorithm.use_kl_in_reward  # verl: KL loss replaces the reward KL
    # the KL loss set in a config file counts as well (it was read off the command line only: KL twice)
    from_file = tmp_path / "kl.yaml"
    from_file.write_text("actor:\n  use_kl_loss: true\n")
    cfg = load_config(from_file, ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4"])
    assert cfg.actor.use_kl_loss and not cfg.algorithm.use_kl_in_reward
    # verl's clip_ratio is only the fallback of clip_ratio_low/high, whatever the order (DAPO's clip-higher)
    for order in (1, -1):
        clip = load_config(None, ["actor_rollout_ref.actor.clip_ratio_high=0.28", "actor_rollout_ref.actor.clip_ratio=0.2"][::order])
        assert (clip.actor.clip_ratio_low, clip.actor.clip_ratio_high) == (0.2, 0.28)
    custom = load_config(None, ["custom_reward_function.path=my_reward.py", "custom_reward_function.name=score"])
    assert custom.algorithm.reward_fn == "my_reward.py:score"
    plain = load_config(None, ["actor.lr=1e-5"])  # no verl spelling: alignrl's own defaults stay
    assert plain.actor.use_kl_loss and plain.actor.entropy_coeff == 0.0 and plain.rollout.top_p == 1.0
    assert plain.actor.forward_micro_batch == plain.actor.ppo_micro_batch_size  # 0: the update's micro-batch
    per_gpu = load_config(None, ["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
                                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4"])
    assert per_gpu.actor.logprob_micro_batch_size == per_gpu.actor.forward_micro_batch == 4
    packed = load_config(None, ["actor_rollout_ref.model.use_remove_padding=True",
                                "critic.model.use_remove_padding=True"])
    assert packed.actor.use_remove_padding and packed.critic.use_remove_padding and not plain.actor.use_remove_padding


def test_the_no_grad_forwards_run_in_logprob_micro_batches(tiny_model_dir):
    from alignrl.placements.build import build_ref
    from alignrl.models.loader import load_model

    cfg = load_config(None, [f"model.path={tiny_model_dir}", "actor.ppo_micro_batch_size=8",
                             "actor.logprob_micro_batch_size=3", "actor.use_kl_loss=true"])
    model, _ = load_model(cfg.model.path)
    scorer = build_ref(cfg, torch.device("cpu"), model)
    rows = []
    scorer.model.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True)
    ids = torch.randint(3, 50, (7, 4))
    scorer.logprobs(ids, torch.ones(7, 4, dtype=torch.bool), ids, torch.ones(7, 4, dtype=torch.bool))
    assert sorted(rows) == [1, 3, 3]  # two lanes run the chunks side by side: their order is the threads'


def test_nnodes_times_gpus_pick_the_local_ranks(capsys, monkeypatch):
    from alignrl.cli import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # 3 ranks cannot split 4 prompts: the launch is refused before torchrun starts, naming the world size
    rc = main(["train", "ppo", "trainer.nnodes=1", "trainer.n_gpus_per_node=3", "data.train_batch_size=4",
               "actor_rollout_ref.actor.ppo_mini_batch_size=4"])
    assert rc == 2 and "multiple of the world size 3" in capsys.readouterr().err


def test_total_epochs_bounds_the_steps_by_the_data(tmp_path):
    write_search_r1_split(tmp_path / "train.parquet", "train")  # 4 rows: 2 batches of 2 per epoch
    base = [f"data.train_files={tmp_path / 'train.parquet'}", "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=2", "trainer.total_epochs=3"]
    assert load_config(None, base).trainer.total_training_steps == 6
    assert load_config(None, base + ["trainer.total_training_steps=4"]).trainer.total_training_steps == 4
    # the first 2 rows only (data.train_max_samples): 1 batch per epoch
    assert load_config(None, base + ["data.train_max_samples=2"]).trainer.total_training_steps == 3


def test_list_form_files_and_data_source_checked_before_the_model(tmp_path, capsys):
    from alignrl.cli import main
    from alignrl.data.loaders import load_samples

    write_search_r1_split(tmp_path / "a.parquet", "train")
    write_search_r1_split(tmp_path / "b.parquet", "train", data_source="hotpotqa")
    samples = load_samples([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")])
    assert [s.data_source for s in samples] == ["nq"] * 4 + ["hotpotqa"] * 4
    assert samples[0].ground_truth == {"target": ["Zorblat Quince"]}
    write_search_r1_split(tmp_path / "c.parquet", "train", data_source="my_trivia")
    start = time.perf_counter()
    rc = main(["train", "ppo", f"data.train_files=[{tmp_path / 'a.parquet'},{tmp_path / 'c.parquet'}]",
               f"data.val_files={tmp_path / 'a.parquet'}", "model.path=/no/such/model"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"{tmp_path / 'c.parquet'} row 0: no reward for data_source 'my_trivia'" in err  # not the model path
    assert "algorithm.reward_fn" in err
    assert time.perf_counter() - start < 20


def test_user_reward_that_raises_names_function_source_and_row(tmp_path):
    from alignrl.rl.scoring import rule_scores
    from alignrl.data.loaders import load_samples
    from alignrl.data.records import Sample
    from alignrl.rewards.registry import ScoreError, load_reward_fn

    (tmp_path / "my_reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if ground_truth['target'] == ['teal']:\n"
        "        raise KeyError('colour')\n"
        "    return 1.0 if ground_truth['target'][0] in solution_str else 0.0\n")
    fn = load_reward_fn(f"{tmp_path / 'my_reward.py'}:compute_score")
    rows = [Sample([{"role": "user", "content": "q"}], {"target": ["Ada"]}, "nq"),
            Sample([{"role": "user", "content": "q"}], "Ada", "hotpotqa")]  # a string: the function raises
    assert rule_scores(fn, "reward function", rows[:1], ["Ada Merrow"]) == [1.0]
    with pytest.raises(ScoreError) as e:
        rule_scores(fn, "reward function", rows, ["Ada", "Ada"])
    msg = str(e.value)
    assert "\n" not in msg and "my_reward.py:compute_score raised TypeError" in msg
    assert "row 1" in msg and "data_source hotpotqa" in msg
    # rows loaded from a data file are named by their place in it, not in the (shuffled) batch
    write_search_r1_split(tmp_path / "train.parquet", "train", data_source="triviaqa")
    loaded = load_samples(str(tmp_path / "train.parquet"))
    batch = [loaded[2], loaded[3]]  # the file's row 2 is the batch's row 0
    with pytest.raises(ScoreError) as e:
        rule_scores(fn, "reward function", batch, ["teal", "Ada"])
    assert str(e.value) == (f"reward function {tmp_path / 'my_reward.py'}:compute_score raised KeyError: 'colour' "
                            f"for {tmp_path / 'train.parquet'} row 2 (data_source triviaqa): fix it so that it "
                            "returns a float (e.g. 0.0 for answers it cannot score)")


def test_wandb_sink_writes_an_offline_run(tmp_path, monkeypatch):
    from alignrl.utils.tracking import Tracker, wandb_mode

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    assert wandb_mode() == "offline"  # no API key: offline, without touching the network
    log_dir = tmp_path / "run" / "logs"
    tracker = Tracker(log_dir, ["wandb", "jsonl"], project="Search-R1-release", run_name="exp")
    logged = []
    real_log = tracker.wandb.log
    tracker.wandb.log = lambda row, **kw: (logged.append((row, kw)), real_log(row, **kw))
    tracker.log(1, {"reward/mean": 0.25})
    tracker.log(2, {"reward/mean": 0.5})
    tracker.close()
    runs = list((log_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    data = runs[0].read_bytes()
    assert len(runs) == 1 and b"reward/mean" in data and b"Search-R1-release" in data and b"train/global_step" in data
    assert json.loads((log_dir / "metrics.jsonl").read_text().splitlines()[0]) == {"step": 1, "reward/mean": 0.25}
    first_id = (log_dir / "wandb_id.txt").read_text()
    # a resume continues the wandb run and logs step 2 again: as a value, since wandb drops a row whose own
    # step is below the highest it has (the re-run steps between the checkpoint and a crash were lost)
    tracker = Tracker(log_dir, ["wandb"], resume_step=1)
    real_log = tracker.wandb.log
    tracker.wandb.log = lambda row, **kw: (logged.append((row, kw)), real_log(row, **kw))
    tracker.log(2, {"reward/mean": 0.75})
    tracker.close()
    assert logged == [({"reward/mean": 0.25, "train/global_step": 1}, {}),
                      ({"reward/mean": 0.5, "train/global_step": 2}, {}),
                      ({"reward/mean": 0.75, "train/global_step": 2}, {})]
    assert (log_dir / "wandb_id.txt").read_text() == first_id
    Tracker(log_dir, ["wandb"]).close()  # a fresh start begins its own: wandb drops steps below a run's highest
    assert (log_dir / "wandb_id.txt").read_text() != first_id
    monkeypatch.setenv("WANDB_MODE", "bogus")  # wandb refuses to start: one line, no traceback
    with pytest.raises(ConfigError, match="wandb could not start in bogus mode") as e:
        Tracker(tmp_path / "run2" / "logs", ["wandb"])
    assert "\n" not in str(e.value)


def _start_retriever(tmp_path: Path) -> tuple[subprocess.Popen, str]:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f'"{a}"\n{q} The answer is {a}.'}) + "\n"
                              for i, (q, a) in enumerate(FACTS)))
    log = tmp_path / "retriever.txt"
    proc = subprocess.Popen([sys.executable, "-m", "alignrl", "serve", "retrieve", "--retriever_name", "bm25",
                             "--corpus_path", str(corpus), "--index_path", str(tmp_path / "index"), "--port", "0"],
                            cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not (m := re.search(r"ready on (http://127\.0\.0\.1:\d+/retrieve)", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            pytest.fail(f"retrieval server did not start: {log.read_text()[-1500:]}")
        time.sleep(0.2)
    return proc, m.group(1)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.timeout(300)
def test_seed_003_command_line_end_to_end(tmp_path, tiny_model_dir):
    write_search_r1_split(tmp_path / "data" / "nq_search" / "train.parquet", "train")
    write_search_r1_split(tmp_path / "data" / "nq_search" / "test.parquet", "test")
    server, url = _start_retriever(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env.pop("WANDB_MODE", None)
    env.pop("WANDB_API_KEY", None)
    env["NETRC"] = str(tmp_path / "no-netrc")  # no wandb key: the wandb logger goes offline by itself
    args = seed_args(**dict(SEED_ENV, BASE_MODEL=str(tiny_model_dir), N_NODES="1")) + [
        "trainer.total_training_steps=2",  # step count
        # a 2-core CPU: one rank (not 8 per node), 4 prompts per step, 8 tokens per turn
        "trainer.n_gpus_per_node=1", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "data.max_response_length=8",
        f"retriever.url={url}",  # the server this test started (port 8000 may be taken on a shared machine)
    ]
    try:
        run = subprocess.run([sys.executable, "-m", "alignrl", "train", "ppo", *args], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=280)
    finally:
        _stop(server)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert re.search(r"base_accuracy=\S+ final_accuracy=\S+ .* steps=2 ", out), out[-2000:]
    assert out.count("not used on this device") == 1
    run_dir = tmp_path / "output" / "nq-search-r1-ppo"
    assert not (run_dir / "logs" / "metrics.jsonl").exists()  # trainer.logger=['wandb'] means wandb alone, as in verl
    (wandb_file,) = (run_dir / "logs" / "wandb").glob("offline-run-*/run-*.wandb")
    logged = wandb_file.read_bytes()
    assert b"reward/mean" in logged and b"Search-R1-release" in logged
    assert b"agent/turns" in logged  # max_turns=4: the multi-turn search rollout made the experience
    assert any((tmp_path / "verl_checkpoints" / "nq-search-r1-ppo").iterdir())  # verl's default_local_dir


def test_verls_critic_warmup_counts_the_steps_before_the_actor_trains():
    """verl trains the actor once global_steps (from 1) reaches trainer.critic_warmup: critic_warmup=3 is two
    critic-only steps, alignrl's critic.warmup_steps=2."""
    for verl, ours in ((0, 0), (1, 0), (3, 2)):
        cfg = load_config(None, [f"trainer.critic_warmup={verl}", "algorithm.adv_estimator=gae"])
        assert cfg.critic.warmup_steps == ours, verl
