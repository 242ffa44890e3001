"""Seed 003 audit: a verl-spelled run keeps every checkpoint as Search-R1's verl does (and verl's
max_*_ckpt_to_keep map onto trainer.max_checkpoints), the keys of Search-R1's ppo_trainer.yaml that alignrl has
no setting for are accepted and listed once, and a Ray job warns once when its checkpoints would land in Ray's
temporary working_dir copy."""

from __future__ import annotations

from pathlib import Path

import pytest

from alignrl.config import ConfigError, load_config
from alignrl.config.verl_keys import translate

VERL = ["actor_rollout_ref.model.path=demo"]  # one verl spelling: the run is verl-style


@pytest.fixture(autouse=True)
def _list_again(monkeypatch):
    monkeypatch.delenv("ALIGNRL_VERL_KEYS_LISTED", raising=False)  # each test sees the one-time listing


def _listed(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if "accepted but not applied" in line]


# ---------------------------------------------------------------------------------------------- checkpoints


def test_a_verl_spelled_run_keeps_every_checkpoint_unless_told():
    assert load_config(None, VERL).trainer.max_checkpoints == 0  # Search-R1's verl never deletes one
    assert load_config(None, ["actor.lr=1e-5"]).trainer.max_checkpoints == 2  # alignrl's own spelling: its default
    assert load_config(None, VERL + ["trainer.max_checkpoints=3"]).trainer.max_checkpoints == 3


@pytest.mark.parametrize("given, kept", [
    (["trainer.max_actor_ckpt_to_keep=null"], 0),
    (["trainer.max_actor_ckpt_to_keep=4"], 4),
    (["trainer.max_actor_ckpt_to_keep=0"], 0),  # verl deletes only for a positive count
    (["trainer.max_actor_ckpt_to_keep=-1"], 0),
    (["trainer.max_critic_ckpt_to_keep=2"], 2),
    # actor and critic share one alignrl checkpoint: the larger request wins, keep-all above any count
    (["trainer.max_actor_ckpt_to_keep=3", "trainer.max_critic_ckpt_to_keep=5"], 5),
    (["trainer.max_actor_ckpt_to_keep=3", "trainer.max_critic_ckpt_to_keep=null"], 0),
])
def test_verls_checkpoints_to_keep_map_onto_max_checkpoints(given, kept):
    # verl's key alone makes the run verl-spelled, so no actor_rollout_ref key is needed beside it
    assert load_config(None, given).trainer.max_checkpoints == kept


def test_a_bad_checkpoints_to_keep_is_one_line():
    with pytest.raises(ConfigError, match=r"trainer.max_actor_ckpt_to_keep=two must be a whole number or null") as e:
        load_config(None, ["trainer.max_actor_ckpt_to_keep=two"])
    assert "\n" not in str(e.value)


@pytest.mark.timeout(300)
def test_a_verl_spelled_run_leaves_every_checkpoint_on_disk(tmp_path, tiny_model_dir):
    """Three saves with alignrl's default of 2 kept would delete global_step_1; the layout is alignrl's
    <default_local_dir>/global_step_N/model, as the README says."""
    from alignrl.runner import train_grpo

    ckpt = tmp_path / "verl_checkpoints" / "run"
    cfg = load_config(None, [
        f"actor_rollout_ref.model.path={tiny_model_dir}", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=2", "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor.ppo_micro_batch_size=4", "data.max_response_length=4", "data.train_size=16", "data.val_size=4",
        "trainer.test_freq=0", "trainer.progress_bar=false", "trainer.logger=[jsonl]",
        f"trainer.output_dir={tmp_path / 'out'}", "trainer.experiment_name=run", "trainer.total_training_steps=3",
        "trainer.save_freq=1", f"trainer.default_local_dir={ckpt}"])
    train_grpo(cfg)
    assert sorted(p.name for p in ckpt.glob("global_step_*")) == ["global_step_1", "global_step_2", "global_step_3"]
    assert all((ckpt / f"global_step_{n}" / "model" / "model.safetensors").is_file() for n in (1, 2, 3))


# ------------------------------------------------------------------- Search-R1's keys without an alignrl setting


SEARCH_R1_YAML_DEFAULTS = [  # verl/trainer/config/ppo_trainer.yaml of Search-R1, values as shipped
    "actor_rollout_ref.actor.shuffle=False", "actor_rollout_ref.actor.ppo_epochs=1",
    "critic.ppo_mini_batch_size=256", "critic.ppo_epochs=1",
    "critic.shuffle=False", "algorithm.state_masking.start_state_marker=<information>",
    "algorithm.state_masking.end_state_marker=</information>",
]


def test_search_r1_yaml_keys_are_accepted_not_rejected(capsys):
    cfg = load_config(None, VERL + SEARCH_R1_YAML_DEFAULTS + ["actor_rollout_ref.actor.ppo_mini_batch_size=256",
                                                              "data.train_batch_size=512"])
    assert cfg.actor.ppo_mini_batch_size == 256 and cfg.actor.ppo_epochs == 1
    listed = _listed(capsys)
    # shuffle=False is the one asking for something alignrl does not do; the critic's sizes equal the actor's
    # and the markers are the tags alignrl's observations carry
    assert listed == ["alignrl: actor_rollout_ref.actor.shuffle=False, critic.shuffle=False are accepted but not "
                      "applied: alignrl draws each epoch's mini-batches in a seeded random order (Search-R1's FSDP "
                      "workers split the batch in order whatever this says)"]


def test_a_value_alignrl_follows_is_accepted_quietly(capsys):
    load_config(None, VERL + ["actor_rollout_ref.actor.shuffle=true", "critic.shuffle=True",
                              "algorithm.state_masking.start_state_marker=<information>",
                              "reward_model.structure_format_score=0", "reward_model.final_format_score=0.0",
                              "reward_model.retrieval_score=0", "+trainer.final_validation=true",
                              "actor_rollout_ref.actor.ppo_epochs=2", "critic.ppo_epochs=2"])
    assert capsys.readouterr().err == ""


def test_the_critics_own_sizes_are_listed_when_they_differ_from_the_actors(capsys, monkeypatch):
    cfg = load_config(None, VERL + ["actor_rollout_ref.actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=4",
                                    "critic.ppo_epochs=2"])
    assert (cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_epochs) == (8, 1)  # the critic trains on these
    (line,) = _listed(capsys)
    assert line.startswith("alignrl: critic.ppo_mini_batch_size=4, critic.ppo_epochs=2 are accepted but not applied")
    assert "actor_rollout_ref.actor.ppo_mini_batch_size and ppo_epochs" in line
    # the actor's value not on the command line (it may come from a config file): listed, never assumed equal
    monkeypatch.delenv("ALIGNRL_VERL_KEYS_LISTED")  # a second launch
    load_config(None, VERL + ["critic.ppo_epochs=1"])
    (line,) = _listed(capsys)
    assert line.startswith("alignrl: critic.ppo_epochs=1 is accepted but not applied")


def test_state_masking_markers_other_than_information_are_listed(capsys):
    cfg = load_config(None, VERL + ["algorithm.state_masking.start_state_marker=<obs>",
                                    "algorithm.state_masking.end_state_marker=</obs>"])
    assert cfg.actor.state_masking  # the mask itself still applies: it comes from the rollout
    (line,) = _listed(capsys)
    assert "start_state_marker=<obs>, algorithm.state_masking.end_state_marker=</obs> are accepted" in line
    assert "the loss mask comes from the rollout" in line


def test_v03_format_reward_credits_are_listed_once_with_the_way_to_apply_them(capsys):
    args = VERL + ["reward_model.structure_format_score=0.2", "reward_model.final_format_score=0.1",
                   "reward_model.retrieval_score=0.1"]
    cfg = load_config(None, args)
    assert cfg.algorithm.reward_fn is None  # Search-R1's data keep the built-in exact-match reward
    (line,) = _listed(capsys)
    assert line.startswith("alignrl: reward_model.structure_format_score=0.2, reward_model.final_format_score=0.1, "
                           "reward_model.retrieval_score=0.1 are accepted but not applied: ")
    assert "alignrl.rewards.qa_em.compute_score_format" in line
    load_config(None, args)
    assert _listed(capsys) == []  # once per launch


def test_final_validation_is_accepted_and_false_is_named(capsys):
    load_config(None, ["+trainer.final_validation=false"])
    err = capsys.readouterr().err
    assert "trainer.final_validation=false: alignrl always evaluates after training (final_accuracy)" in err


def test_a_key_given_twice_is_listed_once_with_its_last_value():
    notes = translate(["critic.shuffle=false", "critic.shuffle=False"]).notes
    assert len(notes) == 1 and notes[0].startswith("critic.shuffle=False is accepted but not applied: ")
    assert translate(["critic.shuffle=false", "critic.shuffle=true"]).notes == []  # the last value is followed


def test_an_interpolated_value_is_not_a_traceback():
    # verl's own default for the critic, spelt out: the actor's value, which alignrl's critic uses anyway
    assert translate(["critic.ppo_epochs=${actor_rollout_ref.actor.ppo_epochs}"]).notes == []
    notes = translate(["critic.ppo_epochs=${trainer.epochs}", "critic.shuffle=${actor.shuffle}"]).notes
    assert [n.split(" is accepted")[0] for n in notes] == ["critic.shuffle=${actor.shuffle}",
                                                         "critic.ppo_epochs=${trainer.epochs}"]


def test_unknown_reward_model_and_critic_keys_are_still_rejected():
    for key in ("reward_model.structure_format_scor=0.2", "critic.model.no_such=1"):
        with pytest.raises(ConfigError, match="unknown config key"):
            load_config(None, [key])


# ------------------------------------------------------------------------ Ray's temporary working_dir copy


def _ray_pkg(tmp_path: Path) -> Path:
    pkg = tmp_path / "ray" / "session_2025-01-01" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123abcd"
    pkg.mkdir(parents=True)
    return pkg


def test_relative_paths_inside_rays_working_dir_copy_are_named(tmp_path, monkeypatch):
    from alignrl.placements.ray.verl_job import temporary_output_warning

    pkg = _ray_pkg(tmp_path)
    monkeypatch.chdir(pkg)  # the job's cwd, as Ray runs it
    cfg = load_config(None, VERL + ["trainer.default_local_dir=verl_checkpoints/exp", "trainer.experiment_name=exp"])
    warning = temporary_output_warning(cfg)
    assert "\n" not in warning
    assert f"the checkpoints ({pkg / 'verl_checkpoints' / 'exp'})" in warning
    assert f"the run folder ({pkg / 'output' / 'exp'})" in warning
    assert "starts again from step 0" in warning
    assert "trainer.default_local_dir and trainer.output_dir an absolute path" in warning

    lasting = tmp_path / "shared"
    cfg = load_config(None, VERL + [f"trainer.default_local_dir={lasting / 'ckpt'}", f"trainer.output_dir={lasting}"])
    assert temporary_output_warning(cfg) is None  # absolute paths elsewhere: nothing to say

    cfg = load_config(None, VERL + [f"trainer.default_local_dir={lasting / 'ckpt'}"])  # output_dir still relative
    warning = temporary_output_warning(cfg)
    assert warning.startswith("warning: the run folder (") and "the checkpoints" not in warning
    assert "logs and summary.json" in warning and "step 0" not in warning


def test_a_link_into_rays_working_dir_copy_counts(tmp_path):
    from alignrl.placements.ray.verl_job import in_ray_working_dir

    pkg = _ray_pkg(tmp_path)
    link = tmp_path / "looks_lasting"
    link.symlink_to(pkg)
    assert in_ray_working_dir(link / "ckpt") and in_ray_working_dir(pkg / "a" / "b")
    assert not in_ray_working_dir(tmp_path / "runtime_resources" / "elsewhere")


def test_the_ray_job_prints_one_warning_line_at_start(tmp_path, monkeypatch, capsys):
    import alignrl.placements.ray.driver as driver
    from alignrl.placements.ray.verl_job import run_on_ray

    started = []

    class Driver:  # stands in for the cluster: the warning must come before any placement
        def __init__(self, job):
            started.append(job)

        def run(self) -> int:
            return 0

    monkeypatch.setattr(driver, "Driver", Driver)
    pkg = _ray_pkg(tmp_path)
    monkeypatch.chdir(pkg)
    cfg = load_config(None, VERL + ["trainer.default_local_dir=verl_checkpoints/exp"])
    capsys.readouterr()
    assert run_on_ray(cfg, "alignrl train ppo") == 0 and len(started) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(lines) == 1 and lines[0].startswith("alignrl train ppo: warning: the checkpoints (")
    assert str(pkg / "verl_checkpoints" / "exp") in lines[0]

    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, VERL + [f"trainer.default_local_dir={tmp_path / 'ckpt'}",
                                    f"trainer.output_dir={tmp_path / 'out'}"])
    assert run_on_ray(cfg, "alignrl train ppo") == 0
    assert "warning" not in capsys.readouterr().err


def test_the_readmes_format_reward_file_gives_search_r1s_credits(tmp_path):
    """The README's format_reward.py, as written there, loaded through custom_reward_function.path."""
    import re
    import textwrap

    from alignrl.rewards.registry import load_reward_fn

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (code,) = re.findall(r"```python\n(  # format_reward\.py.*?)  ```", readme, re.DOTALL)
    (tmp_path / "format_reward.py").write_text(textwrap.dedent(code))
    cfg = load_config(None, VERL + [f"custom_reward_function.path={tmp_path / 'format_reward.py'}"])
    score = load_reward_fn(cfg.algorithm.reward_fn)
    truth = {"target": ["Paris"]}
    well_formed_wrong = "<think>it is</think>\n<answer>Lyon</answer>"
    assert score("nq", "<think>x</think>\n<answer>Paris</answer>", truth) == 1.0
    assert score("nq", well_formed_wrong, truth) == pytest.approx(0.2)  # structure credit
    assert score("nq", "<answer>Lyon</answer> and more", truth) == pytest.approx(0.1)  # final-format credit
