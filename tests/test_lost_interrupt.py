"""A Ctrl-C whose KeyboardInterrupt Python swallowed (raised inside a finalizer or a weakref callback, such as an
import lock's, it is printed as "Exception ignored" and the rank runs on) still ends the rank as an interruption:
the loop stops at its next step, and a rank that meets its peers gone says "interrupted", exit 130."""

import pytest

from alignrl import cli
from alignrl.runtime import env


@pytest.fixture
def swallowed_ctrl_c(monkeypatch):
    monkeypatch.setattr(env, "_interrupted", True)  # the handler ran; its exception went nowhere
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")


def test_a_rank_that_finds_its_peers_gone_after_a_lost_ctrl_c_says_interrupted(swallowed_ctrl_c, monkeypatch,
                                                                              capsys):
    def lost(args, cfg):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:32405")

    monkeypatch.setattr(cli, "_run", lost)
    assert cli.main(["train", "grpo", "trainer.total_training_steps=1"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ": interrupted" in err[0] and "lost its connection" not in err[0], err


def test_the_loop_stops_at_its_next_step(swallowed_ctrl_c, monkeypatch, tmp_path):
    monkeypatch.delenv("WORLD_SIZE")
    from alignrl.config import load_config
    from alignrl.runner import train_grpo

    cfg = load_config(None, ["trainer.total_training_steps=2", "data.train_size=8", "data.val_size=4",
                             "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2", "rollout.max_new_tokens=4",
                             "trainer.progress_bar=false", f"trainer.output_dir={tmp_path}"])
    with pytest.raises(KeyboardInterrupt):
        train_grpo(cfg)
    assert not list(tmp_path.rglob("global_step_1"))  # no step ran
