"""The search demo through verl's tool agent loop (`alignrl demo search --tool-loop`): the base model's SFT text is
token for token what the loop plays against verl's SearchTool and the retrieval server, and a short run completes
with its summary."""

import json
from dataclasses import replace

import pytest

from alignrl.demos import search, search_data, search_tools
from alignrl.demos.search_model import SHIPPED_TOOLS, SearchRecipe, _tool_phases, demo_recipe
from alignrl.models.tiny import TinyRecipe


@pytest.fixture(scope="module")
def small_world():
    return search_data.build_world(0, search_data.WorldSize(people=(40, 8, 8)))


def test_sft_text_is_what_the_tool_loop_plays(small_world, tmp_path):
    """Teacher-forced through the real loop (the run's config, verl's SearchTool at the retrieval server over the
    world's corpus): the prompt, the turns and the tool turns are the SFT's ids, its loss mask the loop's."""
    from alignrl.config import load_config
    from alignrl.data.collate import encode_prompts
    from alignrl.interfaces import SamplingParams
    from alignrl.placements.episodes import with_tools
    from alignrl.rollout.env_agent import with_labels
    from alignrl.rollout.verl_tools import tool_schemas
    from scripted_engine import ScriptedEngine

    world = small_world
    tok, phases = _tool_phases(world, SearchRecipe(loop="tool", arch=replace(TinyRecipe(), vocab_size=800)),
                               tmp_path / "tok")
    (sft_prompts, pairs, _), (mix_prompts, mix_pairs, _) = phases
    (tmp_path / "world").mkdir()
    corpus = tmp_path / "world" / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in search_data.corpus_rows(world)))
    samples = search_tools.tool_samples(world.facts["sft"], "sft")
    server = search.retrieval_server(corpus, topk=1)
    try:
        path = search_tools.write_tool_config(tmp_path / "tools.yaml", f"{server.url}/retrieve", topk=1)
        cfg = load_config(search.TOOLS_CONFIG, [f"agent.tool_config_path={path}"])
        prompts = encode_prompts(tok, samples, cfg.data.max_prompt_length, tools=tool_schemas(str(path)))
        assert prompts == sft_prompts and prompts == mix_prompts  # the run's prompts are the SFT's
        turns = {}
        for p, (ids, mask) in zip(prompts, pairs):  # phase 1: every trajectory searches; split at its tool turn
            a = mask.index(False)
            b = a + mask[a:].index(True)
            turns[tuple(p)] = [ids[:a], ids[b:]]
        engine = ScriptedEngine(turns, key=lambda ctx: next(k for k in turns if tuple(ctx[:len(k)]) == k))
        looped = with_tools(cfg, engine, tok)
        ro = looped.generate(with_labels(looped, samples, prompts), SamplingParams(n=1, max_new_tokens=48))
    finally:
        server.stop()
    for i, (ids, mask) in enumerate(pairs):
        n = int(ro.response_mask[i].sum())
        assert ro.response_ids[i, :n].tolist() == ids and ro.loss_mask[i, :n].tolist() == mask
    assert ro.stats["env/tool_calls"].tolist() == [1.0] * len(pairs)
    assert not ro.stats["env/tool_call_parse_errors"].any()
    # the mix: some guess in a single turn, and every trajectory's text is the loop's format
    guessing = [ids for ids, mask in mix_pairs if all(mask)]
    assert 0 < len(guessing) < len(mix_pairs)
    assert all(tok.decode(ids).endswith("</answer><|im_end|>") for ids in guessing)


def test_the_tool_template_renders_the_schemas_and_appends_tool_turns(tmp_path):
    from alignrl.rollout.tool_calls import ToolChat

    schemas = search_tools.demo_schemas(tmp_path)
    tok, _ = _tool_phases(search_data.build_world(0, search_data.WorldSize(people=(4, 2, 2))),
                          SearchRecipe(loop="tool", copy_steps=0, sft_steps=0), tmp_path / "tok")
    chat = ToolChat(tok, schemas)
    assert chat.prints_schemas and '"name": "search"' in chat.prompt([{"role": "user", "content": "q"}])
    assert chat.feedback(["r"]) == "<|im_start|>tool\nr<|im_end|>\n<|im_start|>assistant\n"
    # without tools, the search demo's ChatML exactly
    msgs = [{"role": "user", "content": "q"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"


def test_the_default_recipes_keep_their_keys_and_ship():
    from alignrl.models.tiny import demo_model_problem

    assert SearchRecipe().key() == "77c978fc300c"  # the Search-R1 build's key from before the loop field
    assert SearchRecipe(loop="tool").key() != SearchRecipe().key()
    assert demo_model_problem(SHIPPED_TOOLS, demo_recipe(0, "tool")) is None
    assert sum(p.stat().st_size for p in SHIPPED_TOOLS.iterdir()) < 6 << 20


TINY_TOOLS = SearchRecipe(arch=replace(TinyRecipe(), vocab_size=600, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                       max_position_embeddings=512),
                          copy_steps=2, sft_steps=2, sft_batch_size=4, loop="tool")


def test_tool_loop_demo_runs_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGNRL_CACHE", str(tmp_path / "cache"))
    overrides = [f"trainer.output_dir={tmp_path}", "trainer.total_training_steps=2", "trainer.test_freq=2",
                 "trainer.progress_bar=false", "trainer.logger=[jsonl]", "data.train_batch_size=2", "rollout.n=2",
                 "actor.ppo_mini_batch_size=2", "data.val_size=4", "data.val_size_during_training=4"]
    summary = search.run(TINY_TOOLS, overrides, heldout=4, log=lambda *_: None)
    run_dir = tmp_path / "search_tools_demo"
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    assert summary["loop"] == "verl_tool_agent_loop" and summary["steps"] == 2 and summary["heldout_questions"] == 4
    for when in ("base", "final"):
        assert 0.0 <= summary[f"{when}_exact_match"] <= 1.0 and summary[f"{when}_searches_per_episode"] >= 0.0
        assert 0.0 <= summary[f"{when}_valid_action_rate"] <= 1.0
    tools = json.loads(json.dumps(__import__("yaml").safe_load((run_dir / "search_tool_config.yaml").read_text())))
    assert tools["tools"][0]["class_name"] == "verl.tools.search_tool.SearchTool"
    assert tools["tools"][0]["config"]["retrieval_service_url"].endswith("/retrieve")
