"""verl 0.7's example scripts run as their users wrote them, shrunk only in model and data paths, GPU and node
counts, batch sizes, lengths and steps. The upstream file and commit each command line comes from is named beside
it (the v0.7.0-era copies stored in the public index: the v0.7.0 tag's own commit was not among them)."""

import subprocess
import sys
from pathlib import Path

import pytest

from alignrl.config import load_config

ROOT = Path(__file__).resolve().parents[1]
ROWS = [("What is 6 * 7?", "42"), ("What is 3 + 4?", "7"), ("What is 9 - 5?", "4"), ("What is 2 * 8?", "16")]


def write_math(path: Path) -> str:
    """verl's GSM8K layout (examples/data_preprocess/gsm8k.py): chat prompt, data_source, rule ground truth."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{q} Let's think step by step "
                                                                                   "and output the final answer "
                                                                                   "after \"####\"."}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": a},
             "extra_info": {"split": "train", "index": i}} for i, (q, a) in enumerate(ROWS)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def grpo_math(model: str, train: str, test: str) -> list[str]:
    """examples/grpo_trainer/run_qwen2-7b_math.sh (volcengine/verl@3f388066), `python3 -m verl.trainer.main_ppo`."""
    return ["algorithm.adv_estimator=grpo", f"data.train_files=['{train}']", f"data.val_files=['{test}']",
            "data.train_batch_size=2", "data.max_prompt_length=256", "data.max_response_length=8",
            "data.filter_overlong_prompts=True", "data.truncation=error", f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.model.use_remove_padding=True",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
            "actor_rollout_ref.model.enable_gradient_checkpointing=True",
            "actor_rollout_ref.actor.fsdp_config.param_offload=False",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.fsdp_config.param_offload=True", "algorithm.use_kl_in_reward=False",
            "trainer.critic_warmup=0", "trainer.logger=['console']", "trainer.project_name=verl_grpo_example_gsm8k_math",
            "trainer.experiment_name=qwen2_7b_function_rm", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
            "trainer.save_freq=20", "trainer.test_freq=5", "trainer.total_epochs=1"]


def ppo_seq_balance(model: str, train: str, test: str) -> list[str]:
    """examples/ppo_trainer/run_qwen2-7b_seq_balance.sh (verl-project/verl@709c8dfb87fd2863823293517b669b0149dedc87),
    `python3 -m verl.trainer.main_ppo`: PPO with a critic and dynamic batch size."""
    return ["algorithm.adv_estimator=gae", f"data.train_files=['{train}']", f"data.val_files=['{test}']",
            "data.return_raw_chat=True", "data.train_batch_size=2", "data.max_prompt_length=256",
            "data.max_response_length=8", "data.filter_overlong_prompts=True", "data.truncation=error",
            f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.actor.optim.lr=1e-6",
            "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.use_dynamic_bsz=True",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512",
            "actor_rollout_ref.actor.fsdp_config.param_offload=False",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False", "actor_rollout_ref.actor.use_kl_loss=False",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.multi_turn.format=hermes", "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=512", "critic.optim.lr=1e-5",
            "critic.model.use_remove_padding=True", f"critic.model.path={model}",
            "critic.model.enable_gradient_checkpointing=True", "critic.ppo_max_token_len_per_gpu=1024",
            "critic.model.fsdp_config.param_offload=False", "critic.model.fsdp_config.optimizer_offload=False",
            "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0", "trainer.logger=['console']",
            "trainer.project_name=verl_example_gsm8k", "trainer.experiment_name=qwen2-7b_seq_packing",
            "trainer.n_gpus_per_node=1", "trainer.val_before_train=False", "trainer.nnodes=1", "trainer.save_freq=-1",
            "trainer.test_freq=5", "trainer.total_epochs=1"]


def dapo(model: str, train: str, test: str, ckpt: str) -> list[str]:
    """recipe/dapo/run_dapo_qwen2.5_32b.sh (lu-jun-yu/verl@d242388afb1fd6f167578ec6f0a16fbb564d4cdf, verl
    0.7.0.dev), `python3 -m recipe.dapo.main_dapo`."""
    return [f"data.train_files={train}", f"data.val_files={test}", "data.prompt_key=prompt", "data.truncation=left",
            "data.max_prompt_length=64", "data.max_response_length=12", "data.gen_batch_size=3",
            "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "algorithm.adv_estimator=grpo",
            "algorithm.use_kl_in_reward=False", "algorithm.kl_ctrl.kl_coef=0.0", "actor_rollout_ref.actor.use_kl_loss=False",
            "actor_rollout_ref.actor.kl_loss_coef=0.0", "actor_rollout_ref.actor.clip_ratio_low=0.2",
            "actor_rollout_ref.actor.clip_ratio_high=0.28", "actor_rollout_ref.actor.clip_ratio_c=10.0",
            "algorithm.filter_groups.enable=True", "algorithm.filter_groups.max_num_gen_batches=10",
            "algorithm.filter_groups.metric=acc", "actor_rollout_ref.model.use_remove_padding=True",
            "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512",
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=512",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=512", f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.model.enable_gradient_checkpointing=True", "actor_rollout_ref.actor.optim.lr=1e-6",
            "actor_rollout_ref.actor.optim.lr_warmup_steps=10", "actor_rollout_ref.actor.optim.weight_decay=0.1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.fsdp_config.param_offload=True",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True", "actor_rollout_ref.actor.entropy_coeff=0",
            "actor_rollout_ref.actor.grad_clip=1.0", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=8",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.80", "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
            "actor_rollout_ref.rollout.enable_chunked_prefill=True", "actor_rollout_ref.rollout.max_num_batched_tokens=512",
            "actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.rollout.top_p=1.0",
            "actor_rollout_ref.rollout.top_k=-1", "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
            "actor_rollout_ref.rollout.val_kwargs.top_p=0.7", "actor_rollout_ref.rollout.val_kwargs.top_k=-1",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=True", "actor_rollout_ref.rollout.val_kwargs.n=1",
            "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.ref.fsdp_config.param_offload=True",
            "actor_rollout_ref.ref.ulysses_sequence_parallel_size=8", "actor_rollout_ref.actor.fsdp_config.fsdp_size=-1",
            "reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=True",
            "reward_model.overlong_buffer.len=4", "reward_model.overlong_buffer.penalty_factor=1.0",
            "trainer.logger=['console']", "trainer.project_name=DAPO", "trainer.experiment_name=DAPO-Qwen2.5-32B",
            "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.val_before_train=True", "trainer.test_freq=5",
            "trainer.save_freq=5", "trainer.total_epochs=1", f"trainer.default_local_dir={ckpt}",
            "trainer.resume_mode=auto"]


@pytest.fixture
def files(tmp_path):
    return write_math(tmp_path / "train.parquet"), write_math(tmp_path / "test.parquet")


def test_the_scripts_translate_to_what_verl_does(files, tmp_path, capsys, monkeypatch):
    train, test = files
    grpo = load_config(None, grpo_math("demo", train, test))
    assert (grpo.algorithm.adv_estimator, grpo.rollout.n, grpo.actor.use_kl_loss, grpo.actor.kl_loss_type) == \
        ("grpo", 2, True, "low_var_kl")
    assert grpo.trainer.save_freq == 20 and not grpo.critic.enable
    ppo = load_config(None, ppo_seq_balance("demo", train, test))
    assert ppo.critic.enable and ppo.critic.model_path == "demo"
    assert ppo.trainer.save_freq == 0  # verl's -1: no periodic checkpoint; alignrl keeps the final one
    monkeypatch.setenv("ALIGNRL_VERL_KEYS_LISTED", "")  # listed once a launch: this load is a launch of its own
    capsys.readouterr()
    d = load_config(None, dapo("demo", train, test, str(tmp_path / "ckpt")))
    a = d.algorithm
    assert (a.dynamic_sampling, a.max_gen_rounds, a.overlong_buffer_len, a.overlong_penalty_factor) == (True, 9, 4, 1.0)
    assert (d.actor.clip_ratio_low, d.actor.clip_ratio_high, d.actor.clip_ratio_c) == (0.2, 0.28, 10.0)
    err = capsys.readouterr().err
    features = [line for line in err.splitlines() if "feature alignrl does not have" in line]
    # named at start, apart from the hardware settings: no device would honour them here
    assert (d.actor.use_dynamic_bsz, d.actor.ppo_max_token_len) == (True, 512)  # micro-batches by a token budget
    assert (grpo.data.filter_overlong_prompts, grpo.data.truncation, d.data.truncation) == (True, "error", "left")
    assert any("Ulysses sequence parallelism" in line and "ulysses_sequence_parallel_size=8" in line
               for line in features), err
    assert "gen_batch_size" not in err and "val_kwargs" not in err  # both applied: DAPO's generation batch, the
    assert (d.data.gen_batch_size, d.data.train_batch_size) == (3, 2)  # validation sampler
    r = d.rollout  # DAPO's: sampled validation at T=1.0, top_p 0.7, one answer a problem
    assert (r.val_temperature, r.val_top_p, r.val_top_k, r.val_n) == (1.0, 0.7, -1, 1)
    assert grpo.rollout.val_temperature == 0.0  # no val_kwargs: greedy
    # verl 0.7's agent loop samples validation with val_kwargs whatever do_sample says, n times a prompt
    sampled = load_config(None, grpo_math("demo", train, test) + [
        "actor_rollout_ref.rollout.val_kwargs.do_sample=False", "actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
        "actor_rollout_ref.rollout.val_kwargs.n=4"])
    assert (sampled.rollout.val_temperature, sampled.rollout.val_n) == (0.6, 4)
    # Search-R1's verl (a key only it reads) samples with them only when do_sample is true
    search_r1 = load_config(None, grpo_math("demo", train, test) + [
        "actor_rollout_ref.rollout.n_agent=2", "actor_rollout_ref.rollout.val_kwargs.do_sample=False",
        "actor_rollout_ref.rollout.val_kwargs.temperature=0.6"])
    assert search_r1.rollout.val_temperature == 0.0
    assert not any("actor.use_dynamic_bsz" in line for line in err.splitlines())  # applied, so not listed


def test_an_overlong_buffer_that_is_off_costs_nothing(files):
    train, test = files
    args = [o for o in dapo("demo", train, test, "c") if not o.startswith("reward_model.overlong_buffer.enable=")]
    assert load_config(None, args + ["reward_model.overlong_buffer.enable=False"]).algorithm.overlong_buffer_len == 0
    assert load_config(None, args).algorithm.overlong_buffer_len == 0  # verl's default: off


@pytest.mark.parametrize("key,value,words", [
    ("data.truncation", "center", "choose one of: left, right, middle, error"),
    ("reward_model.reward_manager", "limo", "naive, dapo, prime, batch or gdpo"),
    ("algorithm.filter_groups.metric", "length", "keeps the groups whose rewards differ"),
    ("actor_rollout_ref.rollout.mode", "sync", "not supported"),
])
def test_what_alignrl_cannot_do_is_one_line(files, key, value, words):
    from alignrl.config import ConfigError

    train, test = files
    with pytest.raises(ConfigError) as e:
        load_config(None, grpo_math("demo", train, test) + [f"{key}={value}"])
    assert words in str(e.value) and key in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("script", ["grpo_math", "ppo_seq_balance"])
def test_main_ppo_scripts_train_a_step(script, tiny_model_dir, files, tmp_path, cli_in_process, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train, test = files
    args = {"grpo_math": grpo_math, "ppo_seq_balance": ppo_seq_balance}[script](str(tiny_model_dir), train, test)
    run = cli_in_process("train", "ppo", *args, "trainer.total_training_steps=1", "trainer.progress_bar=false",
                         f"trainer.output_dir={tmp_path / 'out'}")
    assert run.returncode == 0, run.stderr[-3000:]
    summaries = list((tmp_path / "out").rglob("summary.json"))
    assert len(summaries) == 1 and (summaries[0].parent / "checkpoints" / "global_step_1").is_dir()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_dapo_recipe_entry_point_trains_a_step(tiny_model_dir, files, tmp_path):
    import os

    from conftest import src_path

    train, test = files
    ckpt = tmp_path / "ckpts"
    args = dapo(str(tiny_model_dir), train, test, str(ckpt))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), src_path()]), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "recipe.dapo.main_dapo", *args, "trainer.total_training_steps=1",
                          "trainer.progress_bar=false", f"trainer.output_dir={tmp_path / 'out'}"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert (ckpt / "global_step_1").is_dir()  # verl's trainer.default_local_dir


def test_a_reward_model_in_the_loop_as_verl_spells_it(files):
    """reward_model.enable=True with reward_model.model.path: the model's score is the reward (verl's reward manager
    returns the model's scores when it runs one); without enable the path is not used, as in verl."""
    from alignrl.config import ConfigError

    train, test = files
    base = grpo_math("demo", train, test)
    on = load_config(None, base + ["reward_model.enable=True", "reward_model.model.path=rm_folder",
                                   "reward_model.micro_batch_size_per_gpu=2", "reward_model.use_reward_loop=True"])
    assert on.algorithm.reward_model == "rm_folder"
    assert load_config(None, base + ["reward_model.model.path=rm_folder"]).algorithm.reward_model == ""
    with pytest.raises(ConfigError, match="reward_model.enable=True needs reward_model.model.path"):
        load_config(None, base + ["reward_model.enable=True"])
    # a reward model of its own tokenizer: the rows re-templated in its chat template (tests/test_rm_template.py)
    assert load_config(None, base + ["reward_model.enable=True", "reward_model.model.path=x",
                                     "reward_model.model.input_tokenizer=other/tokenizer"]
                       ).algorithm.reward_model_retemplate


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_step_scored_by_a_reward_model_in_the_loop(tiny_model_dir, files, tmp_path, cli_in_process, monkeypatch):
    """A sequence-classification folder of the policy's vocabulary scores the step (its score is the reward)."""
    import json

    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    rm_dir = tmp_path / "rm"
    AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1).save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(rm_dir)
    monkeypatch.chdir(tmp_path)
    train, test = files
    run = cli_in_process("train", "ppo", *grpo_math(str(tiny_model_dir), train, test), "reward_model.enable=True",
                         f"reward_model.model.path={rm_dir}", "trainer.total_training_steps=1",
                         "trainer.progress_bar=false", f"trainer.output_dir={tmp_path / 'out'}",
                         "trainer.logger=[console,jsonl]")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in next((tmp_path / "out").rglob("metrics.jsonl")).read_text().splitlines()]
    step = [r for r in rows if r.get("step") == 1][-1]
    # a random scoring head's scores: real numbers that differ between responses, where the rule reward on 8
    # tokens of an untrained model is all zeros
    assert step["reward/std"] > 0 and step["reward/accuracy"] == 0.0, step


def test_overlong_prompts_are_dropped_counted_or_stop_the_run(tiny_model, capsys):
    """data.filter_overlong_prompts drops, at load, the rows whose whole prompt is over data.max_prompt_length (both
    splits, counted); data.truncation=error stops at such a row, naming it, where left keeps its last tokens."""
    from alignrl.data.collate import PromptTooLong, prompt_ids
    from alignrl.data.prompts import PromptData, load_task_data
    from alignrl.data.records import Sample

    _, tok = tiny_model
    cfg = load_config(None, ["data.train_size=40", "data.val_size=20", "data.filter_overlong_prompts=true",
                             "data.max_prompt_length=64"])
    lengths = [len(prompt_ids(tok, s)) for s in load_task_data(load_config(None, ["data.train_size=40"]))[0]]
    train, val = load_task_data(cfg, tok)
    assert len(train) == sum(n <= 64 for n in lengths) < 40 and all(len(prompt_ids(tok, s)) <= 64 for s in train)
    assert "dropped" in capsys.readouterr().out
    assert len(load_task_data(cfg)[0]) == 40  # a check without the tokenizer keeps every row
    long = Sample(messages=[{"role": "user", "content": "seven " * 80}], ground_truth="7", source="rows.jsonl:3")
    assert len(PromptData(tok, [long], 64)(range(1))[1][0]) == 64  # left: the last 64 tokens
    with pytest.raises(PromptTooLong, match=r"rows.jsonl:3: its prompt is \d+ tokens, over data.max_prompt_length=64"):
        PromptData(tok, [long], 64, "error")(range(1))
