"""OpenRLHF's post-0.6 `train_ppo_ray` flags (0.7-0.9 and the current dotted spelling): each as the alignrl config
keys it maps to, or one line saying why alignrl cannot follow it; its dotted parser's own defaults; and real
OpenRLHF / LMM-R1 scripts through the checks `train ppo-ray` runs before Ray starts. No Ray cluster needed."""

import json

import pytest

from alignrl.compat import openrlhf_dotted as D
from alignrl.compat import openrlhf_flags as F
from alignrl.compat import openrlhf_keys as K
from alignrl.compat import openrlhf_ppo_ray as P
from alignrl.config import ConfigError, load_config

# enough for every flag check: 8 actor GPUs, one engine per GPU, group estimator with 8 samples
BASE = ["--actor_num_gpus_per_node", "8", "--ref_num_gpus_per_node", "8", "--vllm_num_engines", "8",
        "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "8", "--rollout_batch_size", "128",
        "--train_batch_size", "128", "--micro_train_batch_size", "2"]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """Two OpenRLHF-style prompt files of 256 rows each (chat messages as a list and as LMM-R1's JSON string)."""
    folder = tmp_path_factory.mktemp("prompts")
    out = []
    for name in ("a.jsonl", "b.jsonl"):
        msgs = [[{"role": "user", "content": f"What is {i}+1?"}] for i in range(256)]
        (folder / name).write_text("".join(json.dumps({"context_messages": m, "prompt": m, "label": str(i + 1),
                                                       "message": json.dumps(m), "answer": str(i + 1), "images": []})
                                           + "\n" for i, m in enumerate(msgs)))
        out.append(str(folder / name))
    return out


def reward_file(folder, body: str):
    path = folder / "reward_func.py"
    path.write_text("import torch\n" + body)
    return str(path)


def config(argv, gpus=False):
    args = F.parser().parse_args(D.to_underscore(argv))
    F.check(args)
    return args, load_config(None, K.overrides(args, gpus, 3))


def test_precision_and_attention_by_name():
    """G1: --param_dtype and --attn_implementation (0.8+) parse; bf16/fp16 give model.dtype on CUDA, float32 on CPU."""
    for given, dtype in ((["--param_dtype", "bf16"], "bfloat16"), (["--param_dtype", "fp16"], "float16"),
                         (["--ds.param_dtype", "fp16"], "float16"), (["--fsdp.param_dtype", "fp32"], "float32"),
                         ([], "float32")):
        assert config(BASE + given, gpus=True)[1].model.dtype == dtype, given
        assert config(BASE + given)[1].model.dtype == "float32"
    args, _ = config(BASE + ["--attn_implementation", "flash_attention_2"])
    assert any(line.startswith("--attn_implementation (not applied") for line in K.unused_here(args, False))
    with pytest.raises(D.DottedFlagError, match="--ds.param_dtype fp8: alignrl takes bf16 or fp16 or fp32"):
        D.to_underscore(["--ds.param_dtype", "fp8"])


def test_clip_higher_gspo_and_held_out_sampling():
    """G2, G7: --eps_clip_low_high (both spellings) replaces --eps_clip; gspo, the held-out sampler; ProRL's
    stop-properly penalty as algorithm.truncated_reward_coef."""
    for flag in ("--eps_clip_low_high", "--actor.eps_clip_low_high"):
        a = config(BASE + [flag, "0.2", "0.27", "--eps_clip", "0.1"])[1].actor
        assert (a.clip_ratio_low, a.clip_ratio_high) == (0.2, 0.27)
    cfg = config(BASE + ["--policy_loss_type", "gspo", "--eval_temperature", "1.0",
                         "--eval_n_samples_per_prompt", "4"])[1]
    assert (cfg.actor.policy_loss, cfg.rollout.val_temperature, cfg.rollout.val_n) == ("gspo", 1.0, 4)
    for flag in ("--stop_properly_penalty_coef", "--reward.stop_properly_penalty_coef"):
        assert config(BASE + [flag, "0.0"])[1].algorithm.truncated_reward_coef == 0.0
    assert config(BASE)[1].algorithm.truncated_reward_coef is None


def test_dynamic_batch_and_token_budgets():
    """G8: --use_dynamic_batch (and --train.dynamic_batch_enable) with its budget; budgets alone change nothing."""
    for argv in (["--use_dynamic_batch", "--train_max_tokens_per_gpu", "9000"],
                 ["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "9000"]):
        a = config(BASE + argv)[1].actor
        assert (a.use_dynamic_bsz, a.ppo_max_token_len) == (True, 9000)
    assert config(BASE + ["--use_dynamic_batch"])[1].actor.ppo_max_token_len == 16192  # OpenRLHF's default
    args, cfg = config(BASE + ["--train_max_tokens_per_gpu", "9000"])
    assert not cfg.actor.use_dynamic_bsz
    assert any("--train_max_tokens_per_gpu (a token budget applies with --use_dynamic_batch only" in x
               for x in K.unused_here(args, False))


@pytest.mark.parametrize("argv, mode, high, low", [
    (["--enable_vllm_is_correction"], "truncate", 2.0, None),  # OpenRLHF 0.8: one bound, 2
    (["--vllm_enable_is_correction", "--vllm_is_truncated_threshold", "3"], "truncate", 3.0, None),
    (["--enable_vllm_is_correction", "--vllm_is_correction_type", "icepop"], "mask", 5.0, 0.5),
    (["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type", "icepop",
      "--algo.advantage.is_correction_threshold", "0.8", "4"], "mask", 4.0, 0.8),
    (["--enable_vllm_is_correction", "--vllm_is_truncated_threshold", "0", "4"], "truncate", 4.0, None),
    (["--enable_vllm_is_correction", "--vllm_is_truncated_threshold", "0.5", "5"], "truncate", 5.0, 0.5),  # tis: clamp
    (["--enable_vllm_is_correction", "--vllm_is_correction_type", "tis"], "truncate", 5.0, 0.5),
    (["--enable_vllm_is_correction", "--use_icepop"], "mask", 5.0, 0.5),  # OpenRLHF's older switch of icepop
    (["--enable_vllm_is_correction", "--vllm_is_truncated_threshold", "0.8", "4", "--use_icepop"], "mask", 4.0, 0.8)])
def test_is_correction_against_the_engine(argv, mode, high, low):
    """G9: OpenRLHF's vLLM IS correction as alignrl's token-level rollout IS."""
    a = config(BASE + argv)[1].algorithm
    assert (a.rollout_is, a.rollout_is_mode, a.rollout_is_threshold, a.rollout_is_threshold_lower) == \
        ("token", mode, high, low)


def test_is_correction_it_cannot_follow():
    args = config(BASE + ["--enable_vllm_is_correction", "--vllm_is_truncated_threshold", "0.5", "5"])[0]
    assert not any(x.startswith("--vllm_is_truncated_threshold") for x in K.unused_here(args, False))  # both bounds
    a = config(BASE + ["--enable_vllm_is_correction", "--vllm_is_correction_type", "seq-mask-tis"])[1].algorithm
    assert (a.rollout_is, a.rollout_is_mode, a.rollout_is_threshold, a.rollout_is_threshold_lower) == \
        ("token", "geo_mask", 5.0, 0.5)  # sequences dropped by their geometric-mean weight outside [0.5, 5]
    with pytest.raises(ConfigError, match="--use_icepop with --vllm_is_correction_type tis: --use_icepop is the older"):
        config(BASE + ["--enable_vllm_is_correction", "--use_icepop", "--vllm_is_correction_type", "tis"])
    args = config(BASE + ["--use_icepop"])[0]
    assert any(x.startswith("--use_icepop") and "without --enable_vllm_is_correction" in x
               for x in K.unused_here(args, False))


def test_dotted_defaults_are_current_openrlhfs():
    """M2: a dotted line gets the dotted parser's lambda 1, value clip 0.5, micro-batches of 1 and bf16 (on CUDA);
    an underscore line keeps the 0.6-era ones, and OpenRLHF's micro-batch of 4 (0.5 to 0.9 alike)."""
    dotted = ["--actor.num_gpus_per_node", "8", "--ref.num_gpus_per_node", "8", "--vllm.num_engines", "8",
              "--algo.advantage.estimator", "gae", "--rollout.batch_size", "128", "--train.batch_size", "128"]
    args, cfg = config(dotted, gpus=True)
    assert (args.lambd, args.value_clip, args.micro_train_batch_size, args.micro_rollout_batch_size) == (1.0, 0.5, 1, 1)
    assert (cfg.algorithm.lam, cfg.critic.cliprange_value, cfg.model.dtype) == (1.0, 0.5, "bfloat16")
    given = config(dotted + ["--algo.advantage.lambd", "0.9", "--train.micro_batch_size", "2"])[0]
    assert (given.lambd, given.micro_train_batch_size) == (0.9, 2)
    plain = F.parser().parse_args([])
    assert (plain.lambd, plain.value_clip, plain.micro_train_batch_size) == (0.95, 0.2, 4)


def test_max_len_is_prompt_and_response_in_all():
    """M1: dotted --data.max_len sets the prompt cap beside --rollout.max_new_tokens, else the response cap; an
    underscore --max_len below the caps' sum is named as not applied, with its reason."""
    assert D.to_underscore(["--data.max_len", "4096", "--rollout.max_new_tokens", "1024"])[-2:] == \
        ["--prompt_max_len", "3072"]
    assert D.to_underscore(["--data.max_len", "2048"])[-2:] == ["--generate_max_len", "1024"]
    with pytest.raises(D.DottedFlagError, match="--data.max_len 1000 leaves -24 tokens"):
        D.to_underscore(["--data.max_len", "1000", "--rollout.max_new_tokens", "1024"])
    args = config(BASE + ["--max_len", "1500"])[0]
    assert any(x.startswith("--max_len (not applied here: each prompt is cut at --prompt_max_len") for x in
               K.unused_here(args, False))
    assert not any("--max_len" in x for x in K.unused_here(config(BASE + ["--max_len", "2048"])[0], False))


def test_several_prompt_files(prompts):
    """G6: comma-separated --prompt_data files are concatenated, or blended by --prompt_data_probs (never listed as
    not applied); a count that does not match the files is one line."""
    argv = BASE + ["--prompt_data", ",".join(prompts), "--input_key", "prompt", "--label_key", "label",
                   "--apply_chat_template"]
    args, cfg = config(argv)
    assert cfg.data.train_files == prompts and cfg.data.val_files == prompts and P.training_steps(args) == 4
    assert cfg.data.train_files_probs == []
    for probs in ("0.5,0.5", "0.7,0.3"):
        args, cfg = config(argv + ["--prompt_data_probs", probs])
        assert cfg.data.train_files_probs == [float(p) for p in probs.split(",")]
        assert not any("--prompt_data_probs" in x for x in K.unused_here(args, False))
    with pytest.raises(ConfigError, match="3 probabilities for 2 --prompt_data files"):
        config(argv + ["--prompt_data_probs", "0.2,0.3,0.5"])


def test_a_python_reward_file_is_the_reward(tmp_path, prompts):
    """G3: --remote_rm_url path/to/file.py loads OpenRLHF's reward_func(queries, prompts, labels) as the reward,
    called one row at a time, a tensor or a {"rewards": ...} dict back; every failure is one line."""
    from alignrl.rewards.registry import RewardError, ScoreError, check_user_fns, load_reward_fn

    path = reward_file(tmp_path, "def reward_func(queries, prompts, labels):\n"
                                 "    assert prompts == [''] and len(queries) == 1\n"
                                 "    return {'rewards': torch.tensor([float(queries[0].strip() == labels[0])]),"
                                 " 'scores': torch.zeros(1), 'extra_logs': {}}\n")
    argv = BASE + ["--prompt_data", prompts[0], "--input_key", "prompt", "--remote_rm_url", path]
    args, cfg = config(argv)
    assert cfg.algorithm.reward_fn == "openrlhf:" + path and cfg.services.reward_url == ""
    check_user_fns(cfg)
    fn = load_reward_fn(cfg.algorithm.reward_fn)
    assert (fn("math", " 3", "3", {}), fn("math", "4", "3", {})) == (1.0, 0.0)
    reward_file(tmp_path, "def reward_func(queries, prompts, labels):\n    return torch.ones(len(queries)) / 2\n")
    assert load_reward_fn(cfg.algorithm.reward_fn)("math", "x", None, {}) == 0.5
    reward_file(tmp_path, "def reward_func(queries, prompts, labels):\n    raise KeyError('answer')\n")
    with pytest.raises(ScoreError, match=r"raised KeyError: 'answer'") as e:
        load_reward_fn(cfg.algorithm.reward_fn)("math", "x", "1", {})
    reward_file(tmp_path, "def compute_score(*a):\n    return 0.0\n")
    with pytest.raises(RewardError, match="defines no function reward_func"):
        load_reward_fn(cfg.algorithm.reward_fn)
    with pytest.raises(ConfigError, match="--remote_rm_url /no/such.py: no such file") as e:
        config(argv[:-1] + ["/no/such.py"])
    assert "\n" not in str(e.value) and "algorithm.reward_fn" not in F.in_flag_terms(str(e.value))


def test_several_reward_urls_share_the_batch(tmp_path):
    """M3: a comma list of reward URLs is services.reward_url as given (the client shards each batch over them); several
    .py files, or a file beside a URL, are one line."""
    urls = "http://a:5000/get_reward,http://b:5000/get_reward"
    assert config(BASE + ["--remote_rm_url", urls])[1].services.reward_url == urls
    path = reward_file(tmp_path, "def reward_func(queries, prompts, labels):\n    return torch.zeros(len(queries))\n")
    for given in (f"{path},{path}", f"{path},http://a:5000/get_reward"):
        with pytest.raises(ConfigError, match="give one .py reward file, or reward service URLs") as e:
            config(BASE + ["--remote_rm_url", given])
        assert "\n" not in str(e.value)


def test_a_vision_model_needs_no_flag(tmp_path, prompts):
    """G4, G5: a model folder whose config.json has a vision_config makes the run vision-language without
    --train_vlm (current LMM-R1): its chat messages are templated; the dotted vision flags map."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "vision_config": {}}))
    argv = BASE + ["--pretrain", str(tmp_path), "--prompt_data", prompts[0], "--input_key", "message",
                   "--remote_rm_url", "http://127.0.0.1:5000/get_reward"]
    assert config(argv)[1].data.apply_chat_template
    args, cfg = config(argv + ["--actor.freeze_visual_encoder", "--data.image_key", "pics",
                               "--data.max_images_per_prompt", "2"])
    assert (cfg.actor.freeze_prefix, cfg.data.image_key) == (["visual"], "pics")
    assert any(x.startswith("--max_images_per_prompt (not applied") for x in K.unused_here(args, False))
    text_model = config(BASE + ["--prompt_data", prompts[0], "--input_key", "prompt", "--label_key", "label"])[1]
    assert not text_model.data.apply_chat_template


def test_flags_not_used_are_named_as_typed():
    argv = ["--actor.num_gpus_per_node", "8", "--ref.num_gpus_per_node", "8", "--vllm.num_engines", "8",
            "--train.max_tokens_per_gpu", "9000", "--ckpt.save_hf", "--rollout.batch_size", "128",
            "--train.batch_size", "128"]
    args = config(argv)[0]
    lines = P.unused_lines(args, False, argv)
    assert any(x.startswith("--train.max_tokens_per_gpu (") for x in lines)
    assert any(x.startswith("--ckpt.save_hf (") for x in lines) and not any("--save_hf_ckpt" in x for x in lines)


def test_an_openrlhf_command_line_gets_no_verl_defaults():
    """OpenRLHF's flags map onto alignrl keys some of which verl spells the same (critic.grad_clip,
    critic.cliprange_value): they must not make the run verl-spelled, whose defaults (verl 0.7's dual-clip,
    Search-R1's nucleus 0.95 and entropy bonus) OpenRLHF does not have."""
    cfg = config(BASE + ["--advantage_estimator", "gae"])[1]
    assert (cfg.actor.clip_ratio_c, cfg.rollout.top_p, cfg.actor.entropy_coeff) == (0.0, 1.0, 0.0)
    assert cfg.critic.weight_decay == 0.0 and cfg.trainer.max_checkpoints != 0


def test_without_cuda_fsdp2_stands_in_for_zero():
    """Every ZeRO stage trains on FSDP2 over the actor ranks without CUDA (unsharded on one rank), DeepSpeed with it."""
    assert config(BASE + ["--zero_stage", "2"])[1].trainer.strategy == "fsdp"
    assert config(BASE + ["--zero_stage", "3"], gpus=True)[1].trainer.strategy == "deepspeed"
