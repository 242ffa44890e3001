"""verl's Search-R1-like example on alignrl: its SearchTool (`verl.tools.search_tool.SearchTool`) against a
/retrieve server, verl's response text, its searchR1_<set> rewards, and the example's script training."""

import asyncio
import json

import pytest

from alignrl.rewards import qa_em
from alignrl.rewards.registry import default_compute_score, ground_truth_problem
from alignrl.rollout.remote import ServiceError
from alignrl.rollout.verl_builtin_tools import MISSING_QUERIES, SearchTool, verl_layout
from alignrl.rollout.verl_tool_api import OpenAIFunctionToolSchema
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
    assert "search_multiturn_grpo: keys alignrl does not read, left unread: trainer.do_debug=false" in \
        capsys.readouterr().err
    # the same key on the command line is refused, with or without Hydra's `+`: a verl key alignrl does not know
    # may be one verl reads, and its feature would be missing
    for given in ("trainer.do_debug=false", "+trainer.do_debug=false"):
        with pytest.raises(ConfigError, match="unknown config key 'trainer.do_debug'"):
            load_config(None, [given])
    with pytest.raises(ConfigError, match="agent.tool_format='qwen' is not allowed"):
        load_config(None, ["agent.tool_format=qwen"])  # alignrl's own key names the format it runs


TOOL_YAML = """tools:
  - class_name: verl.tools.search_tool.SearchTool
    config:
      retrieval_service_url: {url}
      num_workers: 120
      rate_limit: 120
      timeout: 30
      type: native
    tool_schema:
      type: function
      function:
        name: search
        description: Searches the web for relevant information based on the given query.
        parameters:
          type: object
          properties:
            query_list:
              type: array
              item:
                type: string
              description: A list of fully-formed semantic queries.
          required:
            - query_list
"""


def _rows(n: int) -> list[dict]:
    """verl's Search-R1-like layout (examples/data_preprocess/preprocess_search_r1_dataset.py)."""
    qa = [("capital of france", "Paris"), ("who wrote hamlet", "William Shakespeare")]
    out = []
    for i in range(n):
        q, a = qa[i % 2]
        kwargs = {"ground_truth": {"target": [a]}, "question": q, "data_source": "searchR1_nq"}
        out.append({"data_source": "searchR1_nq", "ability": "fact-reasoning",
                    "prompt": [{"role": "system", "content": "You are a helpful and harmless assistant."},
                               {"role": "user", "content": f"Answer the question, searching if you need to. "
                                                           f"Question: {q}"}],
                    "reward_model": {"ground_truth": {"target": [a]}, "style": "rule"},
                    "extra_info": {"index": i, "need_tools_kwargs": True, "question": q, "split": "train",
                                   "tools_kwargs": {"search": {"create_kwargs": kwargs}}}, "metadata": None})
    return out


def test_an_episode_searches_reads_verls_result_and_is_scored_by_verls_search_reward(tiny_model, tmp_path,
                                                                                    retrieval_stub):
    from alignrl.data.collate import prompt_ids
    from alignrl.data.records import Sample
    from alignrl.interfaces import SamplingParams
    from alignrl.rl.scoring import RewardStage
    from alignrl.rollout.env_agent import EnvRollout, TaskPrompt
    from alignrl.rollout.verl_tools import ToolLoop, tool_environment
    from scripted_engine import ScriptedEngine

    _, tok = tiny_model
    row = Sample([{"role": "user", "content": "capital of france?"}], {"target": ["Paris"]}, "searchR1_nq")
    prompt = TaskPrompt(prompt_ids(tok, row), row)
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    call = enc('<tool_call>{"name": "search", "arguments": {"query_list": ["capital of france"]}}</tool_call>')
    answer = enc(" so <answer>Paris</answer>")
    engine = ScriptedEngine({tuple(prompt): [call, answer]}, key=lambda p: tuple(p[:len(prompt)]))
    path = tmp_path / "search_tool_config.yaml"
    path.write_text(TOOL_YAML.format(url=retrieval_stub))
    make = tool_environment(str(path), tok, ToolLoop(max_assistant_turns=2))
    ro = EnvRollout(engine, tok, make, response_cap=600).generate([prompt], SamplingParams(max_new_tokens=300))
    second_turn = tok.decode(engine.calls[1][0][0], skip_special_tokens=False)
    assert json.dumps({"result": 'Doc 1 (Title: "Stub")\nabout capital of france'}) in second_turn
    assert ro.stats["env/tool_calls"].tolist() == [1.0] and ro.stats["turns"].tolist() == [2.0]
    stage = RewardStage(tok, default_compute_score, default_compute_score, 600)
    assert stage.score(ro, [row]).rewards.tolist() == [1.0]


def test_verls_search_r1_like_script_trains_against_a_retrieval_server(tiny_model_dir, tmp_path, cli_in_process,
                                                                       retrieval_stub, monkeypatch):
    """examples/sglang_multiturn/search_r1_like/run_qwen2.5-3b_instruct_search_multiturn.sh as written (sizes cut to
    the tiny model), its config file, tool config and data layout: two GRPO steps against a /retrieve server."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.chdir(tmp_path)
    (tmp_path / "search_multiturn_grpo.yaml").write_text(SEARCH_CONFIG)
    (tmp_path / "search_tool_config.yaml").write_text(TOOL_YAML.format(url=retrieval_stub))
    pq.write_table(pa.Table.from_pylist(_rows(8)), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(_rows(4)), tmp_path / "test.parquet")
    got = cli_in_process(
        "train", "ppo", f"--config-path={tmp_path}", "--config-name=search_multiturn_grpo",
        "algorithm.adv_estimator=grpo", "data.train_batch_size=2", "data.val_batch_size=256",
        "data.max_prompt_length=256", "data.max_response_length=24", "data.filter_overlong_prompts=True",
        "data.truncation='error'", "data.return_raw_chat=True", f"actor_rollout_ref.model.path={tiny_model_dir}",
        "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.285",
        "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False", "actor_rollout_ref.rollout.max_model_len=15000",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.name=sglang",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.5", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True", "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0", "trainer.logger=['console','jsonl']", "trainer.project_name='search_r1_like'",
        "trainer.experiment_name='qwen2.5-3b-instruct_search'", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        "trainer.save_freq=100", "trainer.test_freq=-1", "data.train_files=train.parquet",
        "data.val_files=test.parquet", "actor_rollout_ref.rollout.multi_turn.tool_config_path=search_tool_config.yaml",
        "trainer.total_epochs=1", "trainer.total_training_steps=2", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        f"trainer.output_dir={tmp_path / 'out'}", "trainer.progress_bar=false")
    assert got.returncode == 0, got.stderr[-3000:] + got.stdout[-3000:]
    rows = [json.loads(line) for line in
            next((tmp_path / "out").glob("*/logs/metrics.jsonl")).read_text().splitlines()]
    steps = [r for r in rows if "agent/turns" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(1.0 <= r["agent/turns"] <= 2.0 for r in steps), steps
