"""The search demo: its seeded world and shipped files, the tokenisation its SFT relies on, and a smoke run
of the whole command (base model, retrieval server, PPO through it, before/after numbers)."""

import json
import os
from dataclasses import replace

import pytest

from alignrl.data.loaders import load_samples
from alignrl.demos import search, search_data
from alignrl.demos.search_model import InProcessSearch, SearchRecipe
from alignrl.models.tiny import TinyRecipe
from alignrl.rewards.registry import default_compute_score
from alignrl.rollout.remote import ServiceError


@pytest.fixture(scope="module")
def world():
    return search_data.build_world(0)


@pytest.fixture(scope="module")
def small_world():  # fewer SFT people: the trajectory checks need not search 9000 questions
    return search_data.build_world(0, search_data.WorldSize(people=(300, 20, 20)))


def test_shipped_files_are_the_seeded_world(tmp_path):
    fresh = search_data.write_data(tmp_path, seed=0)
    shipped = search.demo_files(0, tmp_path / "unused")
    assert fresh["corpus"].read_text() == shipped["corpus"].read_text()
    for split in ("train", "test"):
        assert load_samples(str(fresh[split])) == load_samples(str(shipped[split]))
    assert sum(p.stat().st_size for p in shipped.values()) < 2 << 20


def test_questions_are_search_r1_rows_answered_only_by_search(world):
    test = load_samples(str(search.demo_files(0, None)["test"]))
    assert len(test) == len(world.facts["test"])
    s, fact = test[0], world.facts["test"][0]
    assert s.data_source == "nq" and s.ground_truth == {"target": [fact.value]}
    assert s.messages[-1]["content"] == search_data.PROMPT_TEMPLATE.format(question=fact.question)
    assert default_compute_score("nq", f"<answer> {fact.value}</answer>", s.ground_truth) == 1.0
    people = {split: {f.person for f in world.facts[split]} for split in search_data.SPLITS}
    assert not (people["sft"] & people["test"]) and not (people["train"] & people["test"])
    assert not (people["sft"] & people["train"])
    # the question itself is a query whose first passage states the answer
    found = InProcessSearch(world, topk=1).search([f.question for f in world.facts["test"]])
    assert all(f.value in text and f.person in text for f, text in zip(world.facts["test"], found))


def test_sft_trajectories_tokenise_as_rollouts_do(small_world, tmp_path):
    from alignrl.demos.search_model import _tokenizer
    from alignrl.rollout.agent import INFO_CLOSE

    world = small_world
    tool = InProcessSearch(world, topk=1)
    samples = search_data.sft_samples(world, tool.observe, search_fraction=0.3, seed=1)
    searching = [s for s in samples if "<search>" in s.extra["answer"]]
    assert 0.2 < len(searching) / len(samples) < 0.4
    tok = _tokenizer(search_data.tokenizer_texts(world, samples), SearchRecipe(), tmp_path)
    for s in searching[:50]:
        text = s.extra["answer"]
        # the rollout's pieces: generated up to </search>, the observation, generated after it
        a = text.index("</search>") + len("</search>")
        b = text.index(INFO_CLOSE) + len(INFO_CLOSE)
        pieces = [tok(p, add_special_tokens=False)["input_ids"] for p in (text[:a], text[a:b], text[b:])]
        assert sum(pieces, []) == tok(text, add_special_tokens=False)["input_ids"]


def test_sft_trains_on_generated_tokens_only(small_world, tmp_path):
    from alignrl.demos.search_model import _tokenizer, trajectory_ids
    from alignrl.rollout.agent import INFO_CLOSE, INFO_OPEN

    world = small_world
    tool = InProcessSearch(world, topk=1)
    samples = search_data.sft_samples(world, tool.observe, search_fraction=0.5, seed=1)
    tok = _tokenizer(search_data.tokenizer_texts(world, samples), SearchRecipe(), tmp_path)
    for s in samples[:40]:
        text = s.extra["answer"]
        ids, mask = trajectory_ids(tok, text)
        assert ids == tok(text + tok.eos_token, add_special_tokens=False)["input_ids"] and len(mask) == len(ids)
        masked = tok.decode([i for i, m in zip(ids, mask) if not m])
        if "<search>" in text:  # the observation, and nothing else, is out of the loss
            obs = text[text.index(INFO_OPEN):text.index(INFO_CLOSE) + len(INFO_CLOSE)]
            assert masked == obs and s.ground_truth["target"][0] in obs
        else:
            assert masked == "" and all(mask)


def test_shipped_base_guesses_greedily_but_can_search_and_copy(world):
    """The base model RL starts from: greedy, it answers without searching (few right); sampled, it
    sometimes searches, copies the answer out of the passage, and is right: the room PPO turns into
    greedy behaviour."""
    import torch

    from alignrl.data.collate import encode_prompts
    from alignrl.demos.search_model import SHIPPED
    from alignrl.interfaces import SamplingParams
    from alignrl.models.loader import load_model
    from alignrl.models.tiny import demo_model_problem
    from alignrl.rollout.agent import AgentRollout
    from alignrl.rollout.hf_engine import HFRolloutEngine

    assert demo_model_problem(SHIPPED, SearchRecipe()) is None  # the default recipe's complete build
    assert sum(p.stat().st_size for p in SHIPPED.iterdir()) < 6 << 20
    model, tok = load_model(str(SHIPPED), "float32", log=lambda *_: None)
    engine = AgentRollout(HFRolloutEngine(model.eval(), tok), tok, InProcessSearch(world, topk=1), max_turns=2,
                          max_obs_length=64)
    facts = world.facts["test"][:24]
    prompts = encode_prompts(tok, search_data.question_samples(facts, "test"), 64)

    def episodes(params):
        ro = engine.generate(prompts, params)
        texts = tok.batch_decode(ro.response_ids.masked_fill(~ro.response_mask, tok.pad_token_id),
                                 skip_special_tokens=True)
        gts = [{"target": [f.value]} for f in facts for _ in range(params.n)]
        right = torch.tensor([default_compute_score("nq", t, g) for t, g in zip(texts, gts)]).view(len(facts), -1)
        return right, ro.stats["searches"].view(len(facts), -1)

    right, searches = episodes(SamplingParams(n=1, temperature=0.0, max_new_tokens=32))
    assert right.mean() <= 0.15 and searches.sum() == 0
    right, searches = episodes(SamplingParams(n=8, temperature=1.0, max_new_tokens=32, seed=0))
    assert 0.1 <= (searches > 0).float().mean() <= 0.6  # searches sometimes...
    assert right[searches > 0].mean() >= 0.8  # ...and then copies the answer
    assert right.max(1).values.mean() >= 0.5  # pass@8 well above greedy


def test_the_held_out_evaluation_takes_a_run_without_tools(world):
    """agent.max_turns=0 makes the plain engine, whose rollouts count no tool use: that was a KeyError."""
    from alignrl.config import load_config
    from alignrl.demos.search_model import SHIPPED

    cfg = load_config(search.CONFIG, ["agent.max_turns=0", "rollout.max_new_tokens=8"])
    got = search.agent_eval(str(SHIPPED), cfg, search_data.question_samples(world.facts["test"][:3], "test"))
    assert got["searches_per_episode"] == 0.0 and got["valid_action_rate"] == 0.0 and 0.0 <= got["exact_match"] <= 1.0


TINY = SearchRecipe(arch=replace(TinyRecipe(), vocab_size=400, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                 max_position_embeddings=512), copy_steps=2, sft_steps=2, sft_batch_size=4)


def test_demo_runs_end_to_end_and_stops_its_server(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGNRL_CACHE", str(tmp_path / "cache"))
    servers = []
    start = search.retrieval_server

    def spy(*a, **k):
        servers.append(start(*a, **k))
        return servers[-1]

    monkeypatch.setattr(search, "retrieval_server", spy)
    overrides = [f"trainer.output_dir={tmp_path}", "trainer.total_training_steps=2", "trainer.test_freq=2",
                 "agent.max_turns=1",
                 "trainer.progress_bar=false", "trainer.logger=[jsonl]", "data.train_batch_size=2", "rollout.n=2",
                 "actor.ppo_mini_batch_size=2", "data.val_size=4", "data.val_size_during_training=4",
                 "rollout.max_new_tokens=8"]
    summary = search.run(TINY, overrides, heldout=4, log=lambda *_: None)
    on_disk = json.loads((tmp_path / "search_demo" / "summary.json").read_text())
    assert on_disk == summary and summary["steps"] == 2 and summary["heldout_questions"] == 4
    for when in ("base", "final"):
        assert 0.0 <= summary[f"{when}_exact_match"] <= 1.0
        assert 0.0 <= summary[f"{when}_valid_action_rate"] <= 1.0
        assert summary[f"{when}_searches_per_episode"] >= 0.0
    rows = [json.loads(line) for line in (tmp_path / "search_demo" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert any("agent/searches_per_episode" in r for r in rows)
    (server,) = servers
    assert server.proc.poll() is not None  # stopped by PID when the run ended
    with pytest.raises(ProcessLookupError):
        os.kill(server.proc.pid, 0)


def test_bad_input_is_one_line(tmp_path):
    from alignrl.config import ConfigError

    with pytest.raises(ServiceError, match="retrieval server did not start") as e:
        search.retrieval_server(tmp_path / "missing.jsonl", topk=1)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="--heldout"):
        search.main(["--heldout", "0"])
    with pytest.raises(ConfigError, match="unrecognized argument"):
        search.main(["--nope"])
    with pytest.raises(ConfigError, match="--build-base takes only --seed"):
        search.main(["--build-base", str(tmp_path / "base"), "trainer.total_training_steps=1"])
    assert not (tmp_path / "base").exists()
