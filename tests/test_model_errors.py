"""Broken model folders give one ModelError line (folder, cause, what to do) through the CLI, and the
demo-model cache is validated, rebuilt when incomplete, and safe to build from several processes."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from alignrl.models.loader import ModelError, load_model
from alignrl.models.tiny import MARKER, TinyRecipe, demo_model_problem, ensure_demo_model

from conftest import TEST_RECIPE, src_path



def _no_weights(d: Path):
    (d / "model.safetensors").unlink()


def _bad_config(d: Path):
    (d / "config.json").write_text('{"model_type": "qwen2", ')


def _truncated(d: Path):
    w = d / "model.safetensors"
    os.truncate(w, w.stat().st_size // 2)


def _no_tokenizer(d: Path):
    (d / "tokenizer.json").unlink()
    (d / "tokenizer_config.json").unlink()


def _no_template(d: Path):
    (d / "chat_template.jinja").unlink()


def _missing_shard(d: Path):
    weights = d / "model.safetensors"
    weights.rename(d / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _unknown_type(d: Path):
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "not_a_model"}))


BREAKS = {
    "no_weights": (_no_weights, "no weights file (looked for model.safetensors, "),
    "bad_config": (_bad_config, "config.json is not valid JSON (JSONDecodeError: "),
    "truncated": (_truncated, "model.safetensors is truncated or corrupt ("),
    "no_tokenizer": (_no_tokenizer, "no tokenizer files (looked for tokenizer.json, "),
    "no_template": (_no_template, "the tokenizer has no chat template; copy chat_template.jinja"),
    "missing_shard": (_missing_shard, "model.safetensors.index.json lists 1 shard(s) that are missing, "
                                      "e.g. model-00002-of-00002.safetensors"),
    "unknown_type": (_unknown_type, "the model cannot be loaded ("),
}


def _broken(tiny_model_dir: Path, tmp_path: Path, kind: str) -> Path:
    folder = tmp_path / kind
    shutil.copytree(tiny_model_dir, folder)
    BREAKS[kind][0](folder)
    return folder


def _args(tmp_path, *overrides) -> list[str]:
    return ["train", "grpo", f"trainer.output_dir={tmp_path}", "data.train_size=8", "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4", "data.val_size=2", "data.val_size_during_training=2",
            "trainer.progress_bar=false", *overrides]


def _cli(tmp_path, *overrides):
    env = {**os.environ, "PYTHONPATH": src_path()}
    proc = subprocess.Popen([sys.executable, "-m", "alignrl", *_args(tmp_path, *overrides)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return _one_line(subprocess.CompletedProcess(proc.args, proc.returncode, "", err))


def _one_line(done: subprocess.CompletedProcess) -> str:
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr[-3000:]
    return lines[0]


def test_each_break_is_one_model_error_in_process(tiny_model_dir, tmp_path):
    for kind, (_, cause) in BREAKS.items():
        folder = _broken(tiny_model_dir, tmp_path, kind)
        with pytest.raises(ModelError) as e:
            load_model(str(folder))
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"model folder {folder}: ") and cause in msg, (kind, msg)
        assert "; " in msg.split(cause, 1)[1] or kind == "no_template", (kind, msg)  # what to do follows


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["no_weights", "bad_config", "truncated", "no_tokenizer", "no_template"])
def test_broken_policy_folder_through_the_cli(kind, tiny_model_dir, tmp_path, cli_in_process):
    folder = _broken(tiny_model_dir, tmp_path, kind)
    if kind == "truncated":  # one case as a real process, the others through the same main() in this one
        line = _cli(tmp_path, f"model.path={folder}")
    else:
        line = _one_line(cli_in_process(*_args(tmp_path, f"model.path={folder}")))
    assert line.startswith(f"alignrl: error: model folder {folder}: ") and BREAKS[kind][1] in line, line


@pytest.mark.slow
def test_broken_reward_model_and_critic_folders_through_the_cli(tiny_model_dir, tmp_path, cli_in_process):
    rm = _broken(tiny_model_dir, tmp_path, "truncated")
    line = _cli(tmp_path, f"model.path={tiny_model_dir}", f"algorithm.reward_model={rm}")
    assert line.startswith(f"alignrl: error: model folder {rm}: model.safetensors is truncated or corrupt"), line
    critic = _broken(tiny_model_dir, tmp_path, "no_weights")
    line = _one_line(cli_in_process(*_args(tmp_path, f"model.path={tiny_model_dir}", "algorithm.adv_estimator=gae",
                                           "critic.enable=true", f"critic.model_path={critic}")))
    assert line.startswith(f"alignrl: error: model folder {critic}: no weights file"), line
    # a causal LM is not a reward model: loading it as one draws a random head, whose scores mean nothing (said from
    # its config.json before the policy loads)
    line = _one_line(cli_in_process(*_args(tmp_path, f"model.path={tiny_model_dir}",
                                           f"algorithm.reward_model={tiny_model_dir}")))
    assert line == (f"alignrl: error: {tiny_model_dir} is not a reward/cost model: it has no scoring head (its "
                    "architecture is Qwen2ForCausalLM); train one with `alignrl train rm`, or save a "
                    "sequence-classification model"), line


# --- the demo-model cache ---------------------------------------------------------------------------

RECIPE = TinyRecipe(**TEST_RECIPE)


def test_incomplete_demo_cache_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGNRL_CACHE", str(tmp_path))
    logs: list[str] = []
    path = ensure_demo_model(RECIPE, log=logs.append)
    assert demo_model_problem(path, RECIPE) is None and not any("is incomplete (" in x for x in logs)
    (path / "model.safetensors").unlink()  # half-populated: the marker is there, the weights are not
    assert "no weights file" in demo_model_problem(path, RECIPE)
    assert ensure_demo_model(RECIPE, log=logs.append) == path
    assert any("is incomplete (model folder" in x and "no weights file" in x for x in logs), logs
    load_model(str(path))
    (path / MARKER).unlink()  # a folder that was never finished
    logs.clear()
    ensure_demo_model(RECIPE, log=logs.append)
    assert any(f"{MARKER} missing or unreadable" in x for x in logs) and demo_model_problem(path, RECIPE) is None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".demo-") and p.is_dir()], "temp folders left"


BUILDER = """
import sys
sys.path.insert(0, {tests!r})
from conftest import TEST_RECIPE
from alignrl.models.tiny import TinyRecipe, ensure_demo_model
print(ensure_demo_model(TinyRecipe(**TEST_RECIPE), log=lambda m: print("LOG", m)))
"""


@pytest.mark.slow
def test_concurrent_builders_share_one_build(tmp_path):
    env = {**os.environ, "PYTHONPATH": src_path(), "ALIGNRL_CACHE": str(tmp_path / "cache")}
    code = BUILDER.format(tests=str(Path(__file__).parent))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(3)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    paths = {o.strip().splitlines()[-1] for o, _ in outs}
    assert len(paths) == 1
    builds = sum(o.count("LOG building demo base model") for o, _ in outs)
    assert builds == 1, [o for o, _ in outs]
    assert demo_model_problem(Path(paths.pop()), RECIPE) is None
