"""OpenRLHF's current dotted flags (`--actor.num_nodes`, `--train.batch_size`, ...) beside the 0.6-era underscore
ones: the same run config from either spelling and errors in the spelling typed. (A dotted script training a step is
test_ray_runs', on that module's Ray cluster.)"""

from alignrl.compat import openrlhf_dotted as D
from alignrl.compat import openrlhf_flags as F
from alignrl.compat import openrlhf_keys as K
from alignrl.compat.openrlhf_ppo_ray import main

PAIRS = [("--actor.num_nodes", "--actor_num_nodes", "2"), ("--actor.num_gpus_per_node", "--actor_num_gpus_per_node", "4"),
         ("--ref.num_nodes", "--ref_num_nodes", "2"), ("--ref.num_gpus_per_node", "--ref_num_gpus_per_node", "4"),
         ("--vllm.num_engines", "--vllm_num_engines", "2"),
         ("--vllm.tensor_parallel_size", "--vllm_tensor_parallel_size", "4"), ("--train.colocate_all", "--colocate_all_models", None),
         ("--algo.advantage.estimator", "--advantage_estimator", "group_norm"),
         ("--rollout.n_samples_per_prompt", "--n_samples_per_prompt", "8"), ("--rollout.batch_size", "--rollout_batch_size", "128"),
         ("--train.batch_size", "--train_batch_size", "128"), ("--train.micro_batch_size", "--micro_train_batch_size", "2"),
         ("--algo.kl.use_loss", "--use_kl_loss", None), ("--algo.kl.init_coef", "--init_kl_coef", "0.001"),
         ("--actor.adam.lr", "--actor_learning_rate", "5e-7"), ("--ds.zero_stage", "--zero_stage", "3"),
         ("--rollout.max_new_tokens", "--generate_max_len", "64"), ("--data.input_key", "--input_key", "prompt"),
         ("--data.label_key", "--label_key", "label"), ("--data.apply_chat_template", "--apply_chat_template", None),
         ("--ckpt.save_steps", "--save_steps", "10"), ("--logger.logging_steps", "--logging_steps", "1")]


def _argv(pairs, dotted: bool) -> list[str]:
    out = []
    for d, u, value in pairs:
        out += [d if dotted else u] + ([value] if value is not None else [])
    return out


def test_both_spellings_give_the_same_flags_and_config():
    dotted = F.parser().parse_args(D.to_underscore(_argv(PAIRS, True) + ["--fsdp.param_dtype", "bf16"]))
    # the dotted parser's own defaults (current OpenRLHF), which a dotted line gets: D.DOTTED_DEFAULTS
    plain = F.parser().parse_args(_argv(PAIRS, False) + ["--param_dtype", "bf16", "--micro_rollout_batch_size", "1",
                                                         "--lambd", "1.0", "--value_clip", "0.5"])
    assert vars(dotted) == vars(plain)
    assert K.overrides(dotted, False, 3) == K.overrides(plain, False, 3)


def test_every_dotted_flag_names_a_flag_of_the_parser():
    known = {s for a in F.parser()._actions for s in a.option_strings}
    assert set(D.DOTTED.values()) <= known


def test_errors_name_the_flags_as_typed(capsys):
    argv = _argv(PAIRS, True)
    bad = [a if a != "128" else "100" for a in argv]  # --train.batch_size 100: not a multiple of the rest
    assert main(bad) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--train.batch_size" in err and "--train_batch_size" not in err, err
    assert main(argv + ["--ds.param_dtype", "fp8"]) == 2
    assert "--ds.param_dtype fp8: alignrl takes bf16 or fp16 or fp32" in capsys.readouterr().err
