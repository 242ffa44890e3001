"""Config loading: YAML + dotted overrides, one-line errors naming the key, the reference table."""

import subprocess
import sys

import pytest
import torch

from alignrl.config import ConfigError, RunConfig, load_config, reference_markdown, to_yaml


def test_yaml_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("actor:\n  lr: 3.0e-5\nrollout:\n  n: 4\n  stop: [\"\\n\\n\"]\n")
    cfg = load_config(f, ["rollout.n=6", "trainer.logger=[jsonl]", "data.system_prompt=Be brief."])
    assert cfg.actor.lr == 3e-5 and cfg.rollout.n == 6 and cfg.rollout.stop == ["\n\n"]
    assert cfg.trainer.logger == ["jsonl"] and cfg.data.system_prompt == "Be brief."
    assert isinstance(cfg, RunConfig)
    # the saved form loads back to the same config
    g = tmp_path / "saved.yaml"
    g.write_text(to_yaml(cfg))
    assert load_config(g) == cfg


def test_each_load_starts_from_the_defaults():
    """Overrides are merged into each load's own tree in place (no copy per override): nothing of one load (a
    list, a nested value, a failed override) reaches the next."""
    default = load_config(None, [])
    changed = load_config(None, ["trainer.logger=[jsonl,tensorboard]", "rollout.stop=[x]", "actor.lr=0.5"])
    assert changed.trainer.logger == ["jsonl", "tensorboard"] and changed.rollout.stop == ["x"]
    with pytest.raises(ConfigError, match="actor.lr"):
        load_config(None, ["trainer.logger=[wandb]", "actor.lr=fast"])
    assert load_config(None, []) == default and default.trainer.logger != changed.trainer.logger


def test_seed_000_nodes_yaml_keys_are_overrides_too(tmp_path):
    """What seed 000's users write in config/nodes.yaml, they may also give on the command line."""
    cfg = load_config(None, ["training.master_port=29600", "models.train.path=demo", "models.base_path=/models",
                             "training.services.generation.url=http://127.0.0.1:8000",
                             f"models.output.path={tmp_path}"])
    assert (cfg.trainer.master_port, cfg.model.path, cfg.services.generation_url) == (29600, "demo",
                                                                                       "http://127.0.0.1:8000")
    assert cfg.run_dir == tmp_path  # the run folder is models.output.path itself, as in the file's layout
    with pytest.raises(ConfigError, match="models.base_path builds the model's folder only inside a nodes.yaml"):
        load_config(None, ["models.base_path=/models"])  # alone it would name nothing: it was dropped silently
    for order in ([f"models.output.path={tmp_path}", "trainer.experiment_name=x"],
                  ["trainer.experiment_name=x", f"models.output.path={tmp_path}"]):
        assert load_config(None, order).run_dir == tmp_path / "x"  # unless a run name is given, in either order


SEED_000_NODES = """training:
  master_node: "gpu007"
  master_port: 29500
  services:
    generation:
      url: "http://gpu004:8000"
    reference:
      url: "http://gpu008:8001"
models:
  base_path: "/data/vayu/train/models"
  train:
    name: "xDAN-L1-Qwen25-7B-Instruct"
    path: "/data/vayu/train/models/xDAN-L1-Qwen25-7B-Instruct"
  output:
    path: "output"
    checkpoint_dir: "checkpoints"
    log_dir: "logs"
"""


def test_seed_000s_own_nodes_yaml_takes_the_hostfile_and_zero3_json_beside_it(tmp_path):
    """The seed's nodes.yaml names neither its hostfile nor its DeepSpeed config: both sit beside it
    (config/hostfile, config/deepspeed/zero3.json). Before, the launcher said "hostfile '-' not found" and the
    ranks trained with DDP."""
    nodes = tmp_path / "config" / "nodes.yaml"
    nodes.parent.mkdir()
    nodes.write_text(SEED_000_NODES)
    bare = load_config(nodes)
    assert (bare.trainer.hostfile, bare.trainer.strategy, bare.trainer.deepspeed_config) == ("", "auto", "")
    (nodes.parent / "hostfile").write_text("gpu007 slots=8\ngpu005 slots=8\n")
    (nodes.parent / "deepspeed").mkdir()
    (nodes.parent / "deepspeed" / "zero3.json").write_text('{"zero_optimization": {"stage": 3}}')
    cfg = load_config(nodes)
    assert cfg.trainer.hostfile == str(nodes.parent / "hostfile") and cfg.model.path.endswith("7B-Instruct")
    assert (cfg.trainer.strategy, cfg.trainer.deepspeed_config) == ("deepspeed", str(nodes.parent / "deepspeed" / "zero3.json"))
    nodes.write_text(SEED_000_NODES + "trainer:\n  strategy: ddp\n")  # what the file names wins
    assert (load_config(nodes).trainer.strategy, load_config(nodes).trainer.deepspeed_config) == ("ddp", "")


def test_a_nodes_yaml_without_models_train_path_trains_base_path_slash_name(tmp_path):
    """The seed spells the model's folder twice (base_path + train.name, and train.path): a file with only the
    first trained the demo model and pushed it to the generation service, with nothing said."""
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text("training:\n  master_port: 29500\nmodels:\n  base_path: /data/models\n  train:\n"
                     "    name: xDAN-L1-Qwen25-7B-Instruct\n")
    assert load_config(nodes).model.path == "/data/models/xDAN-L1-Qwen25-7B-Instruct"
    nodes.write_text("models:\n  base_path: /data/models\n  train:\n    name: x\n    path: /elsewhere/x\n")
    assert load_config(nodes).model.path == "/elsewhere/x"  # train.path, when given, is the folder


def test_an_empty_value_empties_a_text_key():
    """`services.generation_url=` (no service) was refused as null for a text key."""
    assert load_config(None, ["services.generation_url="]).services.generation_url == ""
    assert load_config(None, ["data.input_template="]).data.input_template is None  # an optional key: unset
    by_column = ["data.prompt_key=q", "data.apply_chat_template=false", "data.train_files=a.jsonl"]
    # a text starting with `#` is the text, not a YAML comment that would leave the key unset
    assert load_config(None, ["data.input_template=### Q: {}", *by_column]).data.input_template == "### Q: {}"
    assert load_config(None, ["data.input_template=null", *by_column]).data.input_template is None


def test_one_value_given_to_a_list_key_is_a_list_of_one():
    """verl's `trainer.logger=wandb` as well as `trainer.logger=['console','wandb']`."""
    assert load_config(None, ["trainer.logger=wandb"]).trainer.logger == ["wandb"]
    assert load_config(None, ["trainer.logger=['console','wandb']"]).trainer.logger == ["console", "wandb"]
    assert load_config(None, ["rollout.stop=END"]).rollout.stop == ["END"]


@pytest.mark.parametrize("overrides, message", [
    (["actor.lrr=1"], "unknown config key 'actor.lrr' (did you mean 'actor.lr'?); allowed under 'actor': lr, "),
    (["trainer.total_steps=1"], "(did you mean 'trainer.total_epochs' or 'trainer.total_training_steps'?)"),
    (["nope=1"], "unknown config key 'nope'; allowed at the top level: model, data"),
    (["rollout.n=abc"], "bad value for 'rollout.n'"),
    (["actor.use_kl_loss=maybe"], "bad value for 'actor.use_kl_loss'"),
    (["rollout.top_p=1.5"], "rollout.top_p=1.5 is out of range; it must be <= 1.0"),
    (["rollout.temperature=0"], "rollout.temperature=0.0 is out of range; it must be > 0.0"),
    (["actor.kl_loss_type=k7"], "actor.kl_loss_type='k7' is not allowed; choose one of: k1, k2, k3"),
    (["data.train_batch_size=1", "rollout.n=1"], "is smaller than one mini-batch, actor.ppo_mini_batch_size="),
    (["actor.lr"], "must look like key.sub=value"),
    (["algorithm.rollout_is=token", "actor.recompute_old_logprobs=false"],
     "algorithm.rollout_is=token needs actor.recompute_old_logprobs=true"),
    (["algorithm.rollout_is=batch"], "algorithm.rollout_is='batch' is not allowed; choose one of: none, token"),
    (["algorithm.rollout_is_mode=clip"], "algorithm.rollout_is_mode='clip' is not allowed"),
    (["algorithm.rollout_is_threshold=0"], "algorithm.rollout_is_threshold=0.0 is out of range"),
    (["algorithm.rollout_is_mode=mask", "algorithm.rollout_is_threshold_lower=2"],
     "algorithm.rollout_is_threshold_lower=2.0 must be below algorithm.rollout_is_threshold=2.0"),
    (["algorithm.rollout_is_mode=mask", "algorithm.rollout_is_threshold=0.5"],
     "algorithm.rollout_is_threshold_lower=default 1/threshold must be below algorithm.rollout_is_threshold=0.5"),
    (["algorithm.rollout_is_threshold_lower=3"], "must be below algorithm.rollout_is_threshold=2.0: truncation clamps"),
    (["algorithm.rollout_is=sequence", "algorithm.rollout_is_mode=geo_mask"], "set algorithm.rollout_is=token"),
    (["algorithm.overlong_buffer_len=65"], "algorithm.overlong_buffer_len=65 must be <= rollout.max_new_tokens=64"),
    (["algorithm.max_gen_rounds=-1"], "algorithm.max_gen_rounds=-1 is out of range"),
    (["agent.max_turns=2", "retriever.url=127.0.0.1:8000/retrieve"],
     "retriever.url='127.0.0.1:8000/retrieve' is not an http(s) URL"),
    (["services.generation_url=127.0.0.1:8110"], "services.generation_url='127.0.0.1:8110' (the seed layout's "
                                                   "training.services.generation.url) is not an http(s) URL"),
    (["services.reference_url=http://"], "services.reference_url='http://' (the seed layout's"),
    (["training.master_prot=29600"], "unknown key 'training.master_prot' in the nodes.yaml layout; known: "),
    (["training.services.generaton.url=http://x:1"], "unknown key 'training.services.generaton.url' in the nodes"),
    (["algorithm.overlong_penalty_factor=-1"], "algorithm.overlong_penalty_factor=-1.0 is out of range"),
    (["algorithm.adv_estimator=gae"], "needs a critic"),
    (["critic.enable=true"], "only used by algorithm.adv_estimator=gae"),
    (["safety.cost_fn=x.py:f"], "needs a cost critic"),
    (["algorithm.adv_estimator=gae", "critic.enable=true", "safety.cost_fn=x.py:f", "safety.cost_model=m"],
     "not both"),
    (["actor.clip_ratio_c=0.5"], "must be > 1"),
    (["actor.betas=[0.9]"], "actor.betas=[0.9] must be two numbers in [0, 1)"),
    (["actor.betas=[0.9,1.5]"], "must be two numbers in [0, 1)"),
    (["data.train_files=[a.jsonl"], "cannot read the value of data.train_files='[a.jsonl' (while parsing"),
    (["algorithm.adv_estimator=rloo", "rollout.n=1", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
      "actor.ppo_micro_batch_size=8"], "rollout.n=1 leaves none to compare with"),
    (["actor.policy_loss=gspo", "actor.clip_ratio_c=3"],
     "applies to actor.policy_loss=ppo_clip, dppo_tv, dppo_kl only"),
    (["algorithm.outcome_baseline=loo"], "set algorithm.adv_estimator=reinforce_plus_plus, or outcome_baseline=none"),
    (["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.outcome_baseline=mean", "rollout.n=1",
      "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size=8"], "set rollout.n >= 2"),
    (["algorithm.whiten_advantages=center"], "applies to reinforce_plus_plus and gae (got grpo)"),
    (["actor.gradient_checkpointing=true", "actor.share_prompt=true"], "does not combine with actor.share_prompt"),
    (["pipeline.placement=zmq", "pipeline.data_port=5555", "pipeline.sync_port=5555"],
     "pipeline.data_port and pipeline.sync_port are both 5555"),
])
def test_bad_values_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_yaml_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("actor: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(f)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")


def test_configs_are_frozen():
    cfg = load_config()
    with pytest.raises(Exception):
        cfg.actor.lr = 1.0  # type: ignore[misc]


def test_reference_lists_every_key():
    ref = reference_markdown()
    for key in ("`actor.ppo_mini_batch_size`", "`rollout.n`", "`trainer.resume_mode`", "`algorithm.reward_fn`"):
        assert key in ref


def test_example_configs_load():
    from pathlib import Path

    examples = sorted((Path(__file__).parents[1] / "examples").glob("*.yaml"))
    assert examples
    for f in examples:
        load_config(f)
    dr = load_config(Path(__file__).parents[1] / "examples" / "dr_grpo.yaml")  # both halves of Dr.GRPO
    assert not dr.algorithm.norm_adv_by_std_in_grpo and dr.actor.loss_agg_mode == "seq-mean-token-sum-norm"
    # the preference trainers' examples (the reference project's keys) load as their own configs
    from alignrl.preference.cli import DPOConfig, RMConfig, load_flat_config

    dpo = load_flat_config(DPOConfig, str(Path(__file__).parents[1] / "examples" / "preference" / "safe_demo_dpo.yaml"),
                           [], {})
    rm = load_flat_config(RMConfig, str(Path(__file__).parents[1] / "examples" / "preference" / "safe_demo_rm.yaml"),
                          [], {})
    assert dpo.loss_type == "safe_mm_dpo" and dpo.use_lora and rm.use_lora is not None


def test_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "alignrl", "--help"], capture_output=True, text=True, check=True).stdout
    for sub in ("train", "demo", "build-demo-model", "config"):
        assert sub in out


def test_train_and_demo_help_name_every_command_and_nproc():
    def help_of(*words):  # argparse wraps the text to the terminal's width: compared with the lines joined
        return " ".join(subprocess.run([sys.executable, "-m", "alignrl", *words, "--help"], capture_output=True,
                                       text=True, check=True).stdout.split())

    train, demo = help_of("train"), help_of("demo")
    assert "ppo-ray" in train and "--nproc N" in train and "its own --help" in train
    assert "--nproc N" in demo and "alignrl demo search" in demo


def test_a_command_with_its_own_flags_is_found_after_the_flags():
    """`alignrl train --config x.yaml dpo ...` ran GRPO (argparse took dpo as the algorithm, then nothing used
    it); the word is found wherever the flags leave it."""
    from alignrl.cli import _passthrough

    assert _passthrough(["train", "--config", "x.yaml", "dpo", "beta=0.2"]) == (
        "alignrl.preference.cli:dpo_main", ["--config", "x.yaml", "beta=0.2"])
    assert _passthrough(["train", "--nproc", "2", "a.b=1", "rm", "--task", "harmless"]) == (
        "alignrl.preference.cli:rm_main", ["--nproc", "2", "a.b=1", "--task", "harmless"])
    assert _passthrough(["demo", "trainer.seed=1", "search"])[0] == "alignrl.demos.search"
    assert _passthrough(["train", "--config", "dpo", "grpo"]) is None  # a file named dpo is the config's value
    assert _passthrough(["train", "grpo", "trainer.experiment_name=dpo"]) is None


def test_an_interrupted_run_says_whether_the_same_command_resumes(tmp_path, monkeypatch):
    """It promised a resume from "the last checkpoint" when none had been written yet (seed 004 checkpoints every
    1000 steps): the same command then started over."""
    import json

    from alignrl.cli import _interrupted_line
    from alignrl.train.checkpoint import write_manifest

    cfg = load_config(None, [f"trainer.output_dir={tmp_path}", "trainer.save_freq=100"])
    assert _interrupted_line(["train", "grpo"], None, cfg) == (
        "alignrl: interrupted before the first checkpoint (one every trainer.save_freq=100 steps): the same command "
        "starts over")
    monkeypatch.setenv("ALIGNRL_PROG", "training_worker.py")
    monkeypatch.setenv("ALIGNRL_FLAG_NAMES", json.dumps({"trainer.save_freq": "--save-steps"}))
    assert _interrupted_line(["train", "grpo"], None, cfg, "stopped by SIGTERM") == (
        "training_worker.py: stopped by SIGTERM before the first checkpoint (one every --save-steps 100 steps): the "
        "same command starts over")
    step = cfg.checkpoint_root / "global_step_2"
    step.mkdir(parents=True)
    torch.save({"step": 2}, step / "trainer_state.pt")
    write_manifest(step)
    assert _interrupted_line(["train", "grpo"], None, cfg) == (
        f"training_worker.py: interrupted; the same command continues from {step}")
    assert _interrupted_line(["config"], None, cfg) == "training_worker.py: interrupted"
    again = load_config(None, [f"trainer.output_dir={tmp_path}", "trainer.resume_mode=disable"])
    assert _interrupted_line(["train", "grpo"], None, again).endswith(
        "interrupted; the same command starts over (trainer.resume_mode=disable; auto continues from the last "
        "checkpoint)")
    assert _interrupted_line(["train", "grpo"], None, None).endswith(
        "interrupted while starting; the same command starts it again (from the run's last checkpoint, if it has "
        "one)")
    final_only = load_config(None, [f"trainer.output_dir={tmp_path / 'other'}", "trainer.save_freq=0"])
    assert "(--save-steps 0 saves the final step only)" in _interrupted_line(["train", "grpo"], None, final_only)


def test_readme_reference_is_current():
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "docs" / "config-reference.md").read_text()
    block = readme.split("<!-- config-reference:start -->\n")[1].split("\n<!-- config-reference:end -->")[0]
    assert block == reference_markdown(), "regenerate with: alignrl config --reference"


def test_verls_strategy_shards_over_several_ranks_only():
    from alignrl.placements.build import resolve_strategy
    from alignrl.runtime.env import DistEnv

    lr = "actor_rollout_ref.actor.optim.lr=1e-6"
    for extra in ([], ["actor_rollout_ref.actor.strategy=fsdp2", "critic.strategy=fsdp"]):
        cfg = load_config(None, [lr, *extra])
        assert cfg.trainer.strategy == "fsdp"
        assert resolve_strategy(cfg, DistEnv()) == "single"  # verl's FSDP over one rank shards nothing
        assert resolve_strategy(cfg, DistEnv(rank=0, world_size=2)) == "fsdp2"
    assert load_config(None, [lr, "trainer.strategy=deepspeed"]).trainer.strategy == "deepspeed"  # alignrl's key wins
    assert load_config(None, ["actor.lr=1e-6"]).trainer.strategy == "auto"  # alignrl's own spelling: its own default
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.actor.strategy=megatron is not supported \(alignrl "
                                          r"shards with FSDP2") as e:
        load_config(None, [lr, "actor_rollout_ref.actor.strategy=megatron"])
    assert "\n" not in str(e.value)


def test_verl_spelled_runs_compute_in_bf16_where_the_gpu_has_it(monkeypatch):
    """As verl's FSDP mixed precision: bf16 compute over fp32 master weights (the engines keep those)."""
    import torch

    lr = "actor_rollout_ref.actor.optim.lr=1e-6"
    assert load_config(None, [lr]).model.dtype == "float32"  # this machine: no bf16 GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert load_config(None, [lr]).model.dtype == "bfloat16"
    assert load_config(None, [lr, "model.dtype=float32"]).model.dtype == "float32"  # given: kept
    assert load_config(None, ["actor.lr=1e-6"]).model.dtype == "float32"  # alignrl's spelling: its own default


def test_several_held_out_answers_need_sampling():
    with pytest.raises(ConfigError, match=r"^rollout.val_n=4 answers a problem need sampling: set rollout.val_temperature"):
        load_config(None, ["rollout.val_n=4"])
    assert load_config(None, ["rollout.val_n=4", "rollout.val_temperature=0.6"]).rollout.val_n == 4


def test_a_list_for_a_mapping_is_one_line():
    with pytest.raises(ConfigError, match=r"bad value for 'data.chat_template_kwargs': .*a list where the key takes a "
                                          r"mapping"):
        load_config(None, ["data.chat_template_kwargs=[1,2]"])
