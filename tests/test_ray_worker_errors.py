"""What the Ray driver says when a worker fails, without a cluster: an unexpected error keeps its traceback in the
run's logs, and a user's error (a reward function that raised) is unwrapped from Ray's nesting into its own line."""

import pytest

ray = pytest.importorskip("ray")


def test_an_unexpected_worker_error_keeps_its_traceback_in_the_run_logs(tmp_path):
    """`ray job submit` shows the driver's output only: the line pointed at a worker log that was not there."""
    from types import SimpleNamespace

    from alignrl.placements.ray.driver import Driver
    from alignrl.config import load_config

    cfg = load_config(None, [f"trainer.output_dir={tmp_path}"])
    said = Driver.keep_traceback(SimpleNamespace(job=SimpleNamespace(cfg=cfg)), SimpleNamespace(name="actor rank 0"),
                                 "Traceback (most recent call last):\n  ...\nKeyError: 'x'")
    path = cfg.log_root / "error-actor_rank_0.txt"
    assert said == f"its traceback: {path}" and path.read_text().endswith("KeyError: 'x'\n")


def test_a_workers_user_error_is_unwrapped_from_rays_nesting():
    """A reward function that raises inside a rollout engine reaches the driver wrapped twice (the engine's task
    error inside the actor rank's), and each wrapper is an instance of the cause's class whose text is the whole
    remote traceback: the driver's line is the ScoreError's own, which survives Ray's pickling."""
    import pickle

    from alignrl.placements.ray.channel import ClusterError
    from alignrl.placements.ray.driver import user_error
    from alignrl.rewards.registry import ScoreError

    cause = pickle.loads(pickle.dumps(ScoreError("r.py:f", "raised KeyError: 'x'", "gsm8k", "fix it", 3)))
    inner = ray.exceptions.RayTaskError("RolloutWorker.batch", "Traceback ...\n" * 30, cause).as_instanceof_cause()
    outer = ray.exceptions.RayTaskError("PolicyRank.run", "Traceback ...\n" * 30, inner).as_instanceof_cause()
    assert isinstance(inner, ScoreError)  # Ray's wrapper passes for the cause: it must be unwrapped, not printed
    got = user_error(outer)
    assert type(got) is ScoreError and str(got) == str(cause) and "\n" not in str(got)
    assert str(got) == "reward function r.py:f raised KeyError: 'x' for row 3 (data_source gsm8k): fix it"
    died = ClusterError("rollout engine 0 died")
    assert user_error(ray.exceptions.RayTaskError("f", "tb", died)) is died
    assert user_error(ray.exceptions.RayTaskError("f", "tb", ZeroDivisionError("bug"))) is None  # a bug stays one
