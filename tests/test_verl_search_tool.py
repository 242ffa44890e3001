"""verl's Search-R1-like example on alignrl: its SearchTool (`verl.tools.search_tool.SearchTool`) against a
/retrieve server, verl's response text, its searchR1_<set> rewards, and the example's script training."""

import asyncio
import json

import pytest

from alignrl.rewards import qa_em
from alignrl.rewards.registry import default_compute_score, ground_truth_problem
from alignrl.rollout.remote import ServiceError
from alignrl.rollout.verl_search_tool import MISSING_QUERIES, SearchTool, verl_layout
from alignrl.rollout.verl_tools import OpenAIFunctionToolSchema
from conftest import one_line

pytestmark = pytest.mark.timeout(240)

SCHEMA = {"type": "function", "function": {
    "name": "search", "description": "Searches the web for relevant information based on the given query.",
    "parameters": {"type": "object", "properties": {"query_list": {
        "type": "array", "item": {"type": "string"},
        "description": "A list of fully-formed semantic queries. The tool will return search results for each query."}},
        "required": ["query_list"]}}}


def _tool(url, **config):
    return SearchTool({"retrieval_service_url": url, "num_workers": 120, "rate_limit": 120, "timeout": 30,
                       "type": "native", **config}, OpenAIFunctionToolSchema.model_validate(SCHEMA))


def test_verls_search_r1_like_reward_quarters_an_answer_among_many_tags():
    truth = {"target": ["Paris", "paris city"]}
    assert qa_em.compute_score_tag_capped("<answer> the Paris </answer>", truth) == 1.0
    assert qa_em.compute_score_tag_capped("<answer>Lyon</answer>", truth, format_score=0.1) == 0.1
    assert qa_em.compute_score_tag_capped("no tag", truth) == 0.0
    sprayed = "<answer>x</answer>" * 10 + "<answer>Paris</answer>"  # 11 of each
    assert qa_em.compute_score_tag_capped(sprayed, truth) == 0.25
    assert qa_em.compute_score(sprayed, truth) == 1.0  # Search-R1's own rule has no cap
    assert qa_em.compute_score_tag_capped("<answer>x</answer>" * 9 + "<answer>Paris</answer>", truth) == 1.0
    # verl's data sources: searchR1_<set>; their ground truth is checked as the data loads, as Search-R1's is
    assert default_compute_score("searchR1_nq", sprayed, truth) == 0.25
    assert default_compute_score("nq", sprayed, truth) == 1.0
    assert "has no 'target' key" in ground_truth_problem("searchR1_hotpotqa", {"answers": ["x"]})


def test_verl_layout_is_verls_passage_text():
    assert verl_layout(['"Paris"\nCapital of France.', '"Lyon"\nA city.']) == \
        'Doc 1 (Title: "Paris")\nCapital of France.\n\nDoc 2 (Title: "Lyon")\nA city.'
    assert verl_layout([]) == ""


def test_a_search_call_answers_verls_json_and_a_call_without_queries_answers_verls_error(retrieval_stub):
    tool = _tool(retrieval_stub, topk=2)

    async def episode():
        instance, _ = await tool.create(create_kwargs={"ground_truth": {"target": ["x"]}})
        got = await tool.execute(instance, {"query_list": ["capital of france", "largest city"]})
        bad = await tool.execute(instance, {"query": "no list"})
        results = await tool.calc_reward(instance)
        await tool.release(instance)
        return got, bad, results, await tool.calc_reward(instance)

    (response, reward, metrics), bad, results, released = asyncio.run(episode())
    assert json.loads(response.text) == {"result": 'Doc 1 (Title: "Stub")\nabout capital of france\n---\n'
                                                   'Doc 1 (Title: "Stub")\nabout largest city'}
    assert reward == 0.0 and metrics == {"query_count": 2, "total_results": 2}
    assert json.loads(bad[0].text) == {"result": MISSING_QUERIES} and bad[1] == 0.0
    assert results == [response.text] and released == []
    assert tool.name == "search"


def test_a_search_server_that_is_down_is_one_line_when_the_tool_is_made(http_servers):
    from alignrl.runtime.ports import free_port

    with pytest.raises(ServiceError) as err:
        _tool(f"http://127.0.0.1:{free_port()}/retrieve", timeout=5)
    assert "retriev" in one_line(str(err.value)) and "\n" not in str(err.value)
    with pytest.raises(Exception, match="retrieval_service_url"):
        SearchTool({"type": "native"}, OpenAIFunctionToolSchema.model_validate(SCHEMA))


SEARCH_CONFIG = """hydra:
  searchpath:
    - file:///somewhere/verl/trainer/config

defaults:
  - ppo_trainer
  - _self_

trainer:
  do_debug: False

data:
  max_prompt_length: 1024
  max_response_length: 1024
  train_batch_size: 256
  return_raw_chat: True
  shuffle: False

actor_rollout_ref:
  hybrid_engine: True
  rollout:
    name: sglang
    multi_turn:
      enable: True
      max_assistant_turns: 2
      format: qwen
"""


def test_the_examples_config_file_reads_with_its_own_key_and_verl_04s_format_name(tmp_path, capsys, monkeypatch):
    """verl's search_multiturn_grpo.yaml as written: a key of its own (trainer.do_debug), which Hydra merges and verl
    never reads, is named and left unread; `format: qwen` (verl 0.4's name of Qwen's hermes calls) is hermes."""
    from alignrl.cli import _parse
    from alignrl.config import ConfigError, load_config

    monkeypatch.delenv("ALIGNRL_VERL_KEYS_LISTED", raising=False)
    (tmp_path / "search_multiturn_grpo.yaml").write_text(SEARCH_CONFIG)
    args = _parse(["train", "ppo", f"--config-path={tmp_path}", "--config-name=search_multiturn_grpo"])
    cfg = load_config(None, args.overrides)
    assert cfg.agent.tool_format == "hermes" and cfg.agent.max_turns == 2 and cfg.data.max_prompt_length == 1024
    assert "trainer.do_debug=false: a key neither verl's trainer nor alignrl reads" in capsys.readouterr().err
    # a new key on the command line is still refused unless it says it adds one (`+`), as Hydra refuses it
    with pytest.raises(ConfigError, match="unknown config key 'trainer.do_debug'"):
        load_config(None, ["trainer.do_debug=false"])
    assert load_config(None, ["+actor_rollout_ref.rollout.my_flag=1"]).agent.tool_format == "hermes"
    with pytest.raises(ConfigError, match="agent.tool_format='qwen' is not allowed"):
        load_config(None, ["agent.tool_format=qwen"])  # alignrl's own key names the format it runs
