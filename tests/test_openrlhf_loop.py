"""OpenRLHF's rollout-loop flags of `train_ppo_ray` in both spellings: dynamic filtering as alignrl's dynamic sampling
by the mean reward's open range, ring attention accepted and listed as not used, the agent function as the
environment file (agent.env_path). No Ray cluster needed."""

import pytest

from alignrl.compat import openrlhf_dotted as D
from alignrl.compat import openrlhf_flags as F
from alignrl.compat import openrlhf_keys as K
from alignrl.compat.openrlhf_ppo_ray import main
from alignrl.config import ConfigError, load_config

# one actor rank (dynamic filtering's placement), a group estimator with 8 samples
ONE = ["--actor_num_gpus_per_node", "1", "--ref_num_gpus_per_node", "1", "--vllm_num_engines", "1",
       "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "8", "--rollout_batch_size", "16",
       "--train_batch_size", "128", "--micro_train_batch_size", "2"]


def config(argv):
    args = F.parser().parse_args(D.to_underscore(argv))
    F.check(args)
    return args, load_config(None, K.overrides(args, False, 3))


@pytest.mark.parametrize("given, band", [
    (["--dynamic_filtering"], [0.0, 1.0]),  # OpenRLHF's default range
    (["--dynamic_filtering", "--dynamic_filtering_reward_range", "0", "1"], [0.0, 1.0]),
    (["--dynamic_filtering", "--dynamic_filtering_reward_range", "0.05", "0.95"], [0.05, 0.95]),
    (["--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.1", "0.9"], [0.1, 0.9]),
    (["--algo.dynamic_filtering_enable"], [0.0, 1.0])])
def test_dynamic_filtering_is_dynamic_sampling_by_the_mean_rewards_range(given, band):
    args, cfg = config(ONE + given)
    assert (cfg.algorithm.dynamic_sampling, cfg.algorithm.dynamic_sampling_range) == (True, band)
    notes = K.unused_here(args, False)
    assert any(x.startswith("--dynamic_filtering (refills the batch until it is full or a whole pass over the "
                            "prompts") for x in notes), notes
    # OpenRLHF refills until its prompts run out: one pass a step, --max_samples synthetic prompts in draws of 16
    assert cfg.algorithm.max_gen_rounds == args.max_samples // 16 - 1


def test_without_dynamic_filtering_nothing_is_filtered():
    args, cfg = config(ONE + ["--dynamic_filtering_reward_range", "0.2", "0.8"])  # the range alone: OpenRLHF ignores it
    assert (cfg.algorithm.dynamic_sampling, cfg.algorithm.dynamic_sampling_range) == (False, [])
    assert not any("dynamic_filtering" in x for x in K.unused_here(args, False))


def test_dynamic_filtering_with_the_overlong_penalty_says_where_the_range_is_tested():
    args, _ = config(ONE + ["--dynamic_filtering", "--overlong_buffer_len", "16", "--generate_max_len", "64"])
    assert any(x.startswith("--overlong_buffer_len (with --dynamic_filtering a reward that comes without 'scores' is "
                            "tested after this penalty")
               for x in K.unused_here(args, False))


@pytest.mark.parametrize("argv, message", [
    (ONE + ["--dynamic_filtering", "--dynamic_filtering_reward_range", "1", "0"],
     "--dynamic_filtering_reward_range 1 0: L must be below H"),
    (ONE[:6] + ["--advantage_estimator", "reinforce", "--rollout_batch_size", "128", "--train_batch_size", "128",
                "--dynamic_filtering"], "--dynamic_filtering compares the samples of a prompt: set --n_samples_per")])
def test_dynamic_filtering_refusals_are_one_line(argv, message):
    with pytest.raises(ConfigError) as e:
        config(argv)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("given, listed", [
    (["--ring_attn_size", "2", "--ring_head_stride", "2"], "--ring_attn_size --ring_head_stride (not used here: ring "),
    (["--ring_attn_size", "4"], "--ring_attn_size (not used here: ring attention splits each sequence"),
    (["--ds.ring_attn_size", "2", "--ds.ring_attn_head_stride", "2"], "--ring_attn_size --ring_head_stride (not used"),
    (["--ring_attn_size", "1", "--ring_head_stride", "4"], None),  # OpenRLHF's own default size: quiet
    (["--ring_attn_size", "1"], None)])
def test_ring_attention_is_accepted_and_listed_once_when_it_would_split(given, listed):
    args, cfg = config(ONE + given)
    ring = [x for x in K.unused_here(args, False) if "ring" in x]
    assert ring == ([] if listed is None else [ring[0]]) and (listed is None or ring[0].startswith(listed)), ring
    dotted = ["--ds.zero_stage", "2"] if any(a.startswith("--ds.") for a in given) else []  # dotted defaults too
    assert cfg == config(ONE + dotted)[1]  # the same run


def test_a_ring_size_below_one_is_refused():
    with pytest.raises(ConfigError, match="--ring_attn_size and --ring_head_stride must be at least 1"):
        config(ONE + ["--ring_attn_size", "0"])


@pytest.mark.parametrize("flag", ["--agent_func_path", "--train.agent_func_path"])
def test_the_agent_function_is_the_environment_file(flag, tmp_path):
    path = tmp_path / "agent_func.py"
    path.write_text("")  # loaded when the rollout engine is built, not by the config
    args, cfg = config(ONE + [flag, str(path)])
    assert (cfg.agent.env_path, cfg.agent.max_turns) == (str(path), 0)  # OpenRLHF bounds episodes by length alone
    assert cfg.agent.lend_prompt_room  # within prompt_max_len + generate_max_len, a short prompt's room lent


def test_an_agent_function_beside_a_reward_url_is_one_line(capsys):
    assert main(ONE + ["--agent_func_path", "agent.py", "--remote_rm_url", "http://127.0.0.1:5000/get_reward"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "--agent_func_path agent.py gives the rewards" in err and "drop --remote_rm_url" in err


def test_a_dotted_refusal_names_the_dotted_flags(capsys):
    dotted = ["--actor.num_gpus_per_node", "8", "--ref.num_gpus_per_node", "8", "--vllm.num_engines", "8",
              "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "8",
              "--rollout.batch_size", "128", "--train.batch_size", "128", "--algo.dynamic_filtering_enable",
              "--algo.dynamic_filtering_range", "1", "0"]
    assert main(dotted) == 2
    err = capsys.readouterr().err
    assert "--algo.dynamic_filtering_range 1 0: L must be below H" in err, err
