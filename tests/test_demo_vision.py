"""`alignrl demo vision`'s pieces: the counting task's pictures and rows (deterministic, LMM-R1's chatml layout, read
by the loop's loader with their images), the rule reward on its answers, and one step of the whole demo with tiny
sizes (base model build, evaluation, RLOO through the loop, summary.json)."""

import json
from dataclasses import replace

import pytest

from alignrl.demos import vision_data as D
from alignrl.rewards.think_answer import score


def test_pictures_and_rows_follow_from_the_seed(tmp_path):
    a = D.write_split(tmp_path / "a", "train", 12, seed=5)
    b = D.write_split(tmp_path / "b", "train", 12, seed=5)
    c = D.write_split(tmp_path / "c", "train", 12, seed=6)
    rows_a, rows_b = a.read_text().splitlines(), b.read_text().splitlines()
    assert [json.loads(r)["answer"] for r in rows_a] == [json.loads(r)["answer"] for r in rows_b]
    assert sorted(p.read_bytes() for p in (tmp_path / "a" / "images").iterdir()) == \
        sorted(p.read_bytes() for p in (tmp_path / "b" / "images").iterdir())
    assert a.read_text() != c.read_text()
    row = json.loads(rows_a[0])
    message = json.loads(row["message"])  # LMM-R1's layout: the message list as a JSON string
    image, text = message[0]["content"]
    assert image["type"] == "image" and image["image"].startswith("file:///") and text["type"] == "text"
    assert row["data_source"] == "think_answer" and row["answer"] == str(D.pictures(12, 5)[0].count)


def test_a_picture_shows_its_cells():
    p = D.Picture(("red", None, "blue", "green") + (None,) * 11 + ("red",), "red")
    img = D.draw(p)
    assert img.size == (D.SIZE, D.SIZE) and p.count == 2
    centre = lambda i: ((i % D.GRID) * D.CELL + D.CELL // 2, (i // D.GRID) * D.CELL + D.CELL // 2)  # noqa: E731
    assert img.getpixel(centre(0)) == D.COLOURS["red"] and img.getpixel(centre(15)) == D.COLOURS["red"]
    assert img.getpixel(centre(1)) == D.BACKGROUND and img.getpixel(centre(2)) == D.COLOURS["blue"]


def test_the_answers_form_scores_as_the_reward_reads_it():
    assert score(D.response("red", 3), "3") == 1.5
    assert score(D.response("red", 4), "3") == 0.5


def test_the_loop_loads_the_rows_with_their_images(tmp_path):
    from alignrl.data.loaders import load_samples

    path = D.write_split(tmp_path, "test", 3, seed=1)
    samples = load_samples(str(path), prompt_key="message", label_key="answer", key="data.val_files")
    assert len(samples) == 3 and all(len(s.images) == 1 for s in samples)
    assert [s.ground_truth for s in samples] == [str(p.count) for p in D.pictures(3, 1)]


def test_bad_arguments_are_one_line():
    from alignrl.config import ConfigError
    from alignrl.demos.vision import main

    with pytest.raises(ConfigError, match="unrecognized argument '--nope'"):
        main(["--nope"])
    with pytest.raises(ConfigError, match="at least 1"):
        main(["--heldout", "0"])


@pytest.mark.timeout(300)
def test_one_step_of_the_demo_with_tiny_sizes(tmp_path, monkeypatch):
    """The whole demo on a base model of a few SFT steps (its own recipe, so its own cache folder), 1 RL step."""
    from alignrl.demos.vision import run
    from alignrl.demos.vision_model import VisionRecipe

    monkeypatch.setenv("ALIGNRL_CACHE", str(tmp_path / "cache"))
    recipe = replace(VisionRecipe(), sft_pictures=16, count_steps=2, slip_steps=1, sft_batch_size=4)
    overrides = [f"trainer.output_dir={tmp_path / 'out'}", "trainer.total_training_steps=1", "data.train_batch_size=2",
                 "rollout.n=2", "data.val_size=4", "data.val_size_during_training=4", "trainer.test_freq=0",
                 "actor.ppo_mini_batch_size=2", "rollout.max_new_tokens=8"]
    summary = run(recipe, overrides, heldout=4, train_rows=8, log=lambda *a: None)
    on_disk = json.loads((tmp_path / "out" / "vision_demo" / "summary.json").read_text())
    assert on_disk == summary
    for key in ("base_accuracy", "final_accuracy", "base_pass@8", "final_pass@8", "base_sampled_accuracy",
                "wall_seconds", "seconds_per_step"):
        assert 0 <= summary[key] and (key.endswith("seconds") or key.endswith("step") or summary[key] <= 1), key
    assert summary["steps"] == 1 and summary["heldout_pictures"] == 4
    assert (tmp_path / "cache" / f"vision-demo-{recipe.key()}" / "recipe.json").is_file()
