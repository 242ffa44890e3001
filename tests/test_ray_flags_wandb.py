"""OpenRLHF's `--use_wandb KEY` on `alignrl train ppo-ray`: the key logs the driver and every actor rank in, and
appears in no config, override, Job or printed line; switch values carry no key. No Ray cluster needed."""

import os

import pytest

from alignrl.compat import openrlhf_flags as F
from alignrl.compat import openrlhf_keys as K
from alignrl.config import load_config


def parse(*argv):
    return F.parser().parse_args(list(argv))


KEY = "0123456789abcdef0123456789abcdef01234567"  # the shape of a wandb API key (40 hex characters)


def no_env(monkeypatch, *names):
    """`names` absent from the environment for this test, and whatever the code sets there undone after it."""
    for name in names:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_use_wandb_key_becomes_the_runs_wandb_api_key_and_nothing_else(tmp_path, monkeypatch, capsys):
    """OpenRLHF logs in with `wandb.login(key=args.use_wandb)`: the key is the driver's and the actor ranks'
    WANDB_API_KEY, and appears in no config, override, Job or printed line."""
    from alignrl.compat.openrlhf_ppo_ray import job, wandb_env
    from alignrl.config import to_yaml

    no_env(monkeypatch, "WANDB_API_KEY")
    args = parse("--use_wandb", KEY, "--save_path", str(tmp_path / "run"), "--total_steps", "1")
    F.check(args)
    env = wandb_env(args)
    assert env == {"WANDB_API_KEY": KEY} and os.environ["WANDB_API_KEY"] == KEY
    placed = job(args, env=env)
    assert placed.rank_env == env and "wandb" in placed.cfg.trainer.logger
    said = to_yaml(placed.cfg) + repr(placed) + " ".join(K.overrides(args, gpus=True, total_steps=1))
    assert KEY not in said + "".join(capsys.readouterr())


def test_the_flags_wandb_key_wins_over_the_environments(monkeypatch, capsys):
    from alignrl.compat.openrlhf_ppo_ray import wandb_env

    monkeypatch.setenv("WANDB_API_KEY", "from-the-environment")
    # as OpenRLHF's wandb.login(key=args.use_wandb); the actor ranks get it too, on other nodes they have none
    assert wandb_env(parse("--use_wandb", KEY)) == {"WANDB_API_KEY": KEY} and os.environ["WANDB_API_KEY"] == KEY
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "its key is used, not the WANDB_API_KEY of the environment" in out
    assert KEY not in out and "from-the-environment" not in out


@pytest.mark.parametrize("value, on", [("True", True), ("1", True), ("YES", True), ("false", False), ("0", False),
                                       ("No", False)])
def test_use_wandb_switch_values_carry_no_key(value, on, monkeypatch):
    from alignrl.compat.openrlhf_ppo_ray import wandb_env

    no_env(monkeypatch, "WANDB_API_KEY")
    args = parse("--use_wandb", value)
    assert F.wandb_key(args) is None and wandb_env(args) == {} and "WANDB_API_KEY" not in os.environ
    cfg = load_config(None, K.overrides(args, gpus=False, total_steps=1))
    assert ("wandb" in cfg.trainer.logger) is on


def test_a_use_wandb_value_that_is_no_key_is_one_line_without_the_value(tmp_path, capsys):
    from alignrl.compat.openrlhf_ppo_ray import main

    assert main(["--use_wandb", "abc def\tghi", "--save_path", str(tmp_path / "run"), "--total_steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--use_wandb takes a wandb API key" in err and "abc" not in err, err


def test_an_actor_rank_logs_with_the_drivers_key(monkeypatch):
    """The driver passes its rank environment with the run call: rank 0's Tracker, which starts wandb, sees the
    key even on a cluster whose workers were not started from the driver's environment."""
    from alignrl import runner
    from alignrl.placements.ray.workers import PolicyRank
    from alignrl.config import to_yaml

    no_env(monkeypatch, "WANDB_API_KEY", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
           "ALIGNRL_DIST_TIMEOUT")
    seen = []
    monkeypatch.setattr(runner, "train_grpo", lambda cfg, producers: seen.append(os.environ.get("WANDB_API_KEY")))
    PolicyRank(0, 1, 0, 0, 60.0).run(to_yaml(load_config(None, [])), ("127.0.0.1", 1), None, {"WANDB_API_KEY": KEY})
    assert seen == [KEY]
