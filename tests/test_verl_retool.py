"""verl's ReTool-style recipe (examples/sglang_multiturn/run_qwen3_4b_dapo_multiturn.sh): a recipe file of its shape —
a code tool subclassing verl's SandboxFusionTool that runs through `execution_pool.execute.remote`, a dataset class
mapping the rows, a reward reading verl's math_dapo and the episode's num_turns — loads and plays with alignrl's
verl modules, against a stand-in sandbox service."""

import http.server
import json
import sys
import textwrap
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import json_reply

RECIPE = textwrap.dedent('''
    import re

    import pyarrow.parquet as pq

    from verl.tools.sandbox_fusion_tools import SandboxFusionTool
    from verl.utils.dataset import RLHFDataset
    from verl.utils.reward_score import math_dapo


    class CustomSandboxFusionTool(SandboxFusionTool):
        """Runs the fenced block of a call, printing its last expression, on the pool verl's tool runs on."""

        async def execute(self, instance_id, parameters, **kwargs):
            code = parameters["code"]
            found = re.findall(r"```python(.*?)```", code, re.DOTALL)
            lines = (found[0].strip() if found else code).split("\\n")
            if not lines[-1].startswith("print"):
                lines[-1] = f"print({lines[-1]})"
            result = await self.execution_pool.execute.remote(self.execute_code, instance_id, "\\n".join(lines),
                                                              self.default_timeout, self.default_language)
            return result, None, None


    class CustomRLHFDataset(RLHFDataset):
        def _read_files_and_tokenize(self):
            self.dataframe = [dict(row, agent_name="tool_agent") for path in self.data_files
                              for row in pq.read_table(path).to_pylist()]


    def compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs):
        result = math_dapo.compute_score(solution_str, ground_truth, strict_box_verify=True)
        if result["score"] < 0:  # credit for calling the tool, from the episode's turns
            result["score"] = min(-0.6, result["score"] + (extra_info["num_turns"] - 2) / 2 * 0.1)
        return result
''')

TOOL_CONFIG = """tools:
  - class_name: "recipe.retool.retool.CustomSandboxFusionTool"
    config:
      sandbox_fusion_url: "{url}"
      num_workers: 128
      enable_global_rate_limit: true
      rate_limit: 128
      default_timeout: 30
      default_language: "python"
      memory_limit_mb: 1024
      type: native
    tool_schema:
      type: "function"
      function:
        name: "code_interpreter"
        description: "A tool for executing code."
        parameters:
          type: "object"
          properties:
            code:
              type: "string"
              description: "The code to execute."
          required: ["code"]
"""


def _rows(n: int) -> list[dict]:
    return [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": f"What is {i} + {i}? Use the tool."}],
             "ability": "MATH", "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
             "extra_info": {"index": i}} for i in range(n)]


@pytest.fixture
def recipe(tmp_path, monkeypatch, http_servers):
    """The recipe's folder as the working folder, with a stand-in sandbox that answers print(2 + 2) with 4."""
    runs, lock = [], threading.Lock()

    class Sandbox(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            code = json.loads(self.rfile.read(int(self.headers["content-length"])))["code"]
            with lock:
                runs.append(code)
            json_reply(self, {"status": "Success", "run_result": {
                "status": "Finished", "return_code": 0, "stdout": "4\n" if code == "print(2 + 2)" else "",
                "stderr": "", "execution_time": 0.01}})

        def log_message(self, *args):
            pass

    url = http_servers(Sandbox) + "/run_code"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipe" / "retool").mkdir(parents=True)
    (tmp_path / "recipe" / "retool" / "retool.py").write_text(RECIPE)
    (tmp_path / "recipe" / "retool" / "sandbox_fusion_tool_config.yaml").write_text(TOOL_CONFIG.format(url=url))
    pq.write_table(pa.Table.from_pylist(_rows(8)), tmp_path / "dapo_train.parquet")
    pq.write_table(pa.Table.from_pylist(_rows(2)), tmp_path / "aime.parquet")
    # `recipe.retool.retool`, as from a verl checkout's folder: a package here, ahead of this repository's own
    # `recipe` shim (python -m recipe.dapo.main_dapo)
    for package in ("recipe", "recipe/retool"):
        (tmp_path / package / "__init__.py").write_text("")
    for name in [m for m in sys.modules if m == "recipe" or m.startswith("recipe.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path, runs


def test_an_episode_runs_the_recipes_tool_and_its_reward_reads_the_turns(recipe, tiny_model):
    from alignrl.data.collate import prompt_ids
    from alignrl.data.records import Sample
    from alignrl.interfaces import SamplingParams
    from alignrl.rewards.registry import load_reward_fn
    from alignrl.rl.scoring import RewardStage
    from alignrl.rollout.env_agent import EnvRollout, TaskPrompt
    from alignrl.rollout.verl_tools import ToolLoop, tool_environment
    from scripted_engine import ScriptedEngine

    folder, runs = recipe
    _, tok = tiny_model
    rows = [Sample([{"role": "user", "content": f"2 + 2? ({i})"}], "4", "math_dapo") for i in range(2)]
    prompts = [TaskPrompt(prompt_ids(tok, r), r) for r in rows]
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    call = enc('<tool_call>{"name": "code_interpreter", "arguments": {"code": "```python\\n2 + 2\\n```"}}</tool_call>')
    script = {tuple(prompts[0]): [call, enc(" so \\boxed{4}")], tuple(prompts[1]): [call, enc(" so \\boxed{5}")]}
    engine = ScriptedEngine(script, key=lambda p: next(k for k in script if tuple(p[:len(k)]) == k))
    make = tool_environment("recipe/retool/sandbox_fusion_tool_config.yaml", tok, ToolLoop(max_assistant_turns=16))
    ro = EnvRollout(engine, tok, make, response_cap=600).generate(prompts, SamplingParams(max_new_tokens=300))
    assert runs == ["print(2 + 2)", "print(2 + 2)"]  # the recipe's wrapping reached the sandbox
    assert "4" in tok.decode(engine.calls[1][0][0], skip_special_tokens=False)
    assert ro.stats["env/verl_num_turns"].tolist() == [4.0, 4.0]  # the prompt, two assistant turns, one tool turn
    reward = load_reward_fn(f"{folder}/recipe/retool/retool.py:compute_score")
    stage = RewardStage(tok, reward, reward, 600)
    # right: verl's DAPO +1; wrong: -1 plus (4 - 2) / 2 * 0.1 for the tool call, at most -0.6
    assert stage.score(ro, rows).rewards.tolist() == pytest.approx([1.0, -0.9])


def test_the_recipes_script_trains(recipe, tiny_model_dir, cli_in_process):
    folder, _ = recipe
    got = cli_in_process(
        "train", "ppo", "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
        "algorithm.kl_ctrl.kl_coef=0.0", "data.train_files=dapo_train.parquet", "data.val_files=aime.parquet",
        "data.return_raw_chat=True", "data.train_batch_size=2", "data.max_prompt_length=256",
        "data.max_response_length=16", "data.filter_overlong_prompts=True", "data.truncation='error'",
        "data.custom_cls.path=recipe/retool/retool.py", "data.custom_cls.name=CustomRLHFDataset",
        "custom_reward_function.path=recipe/retool/retool.py", "custom_reward_function.name=compute_score",
        f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.clip_ratio_low=0.2",
        "actor_rollout_ref.actor.clip_ratio_high=0.28", "actor_rollout_ref.actor.clip_ratio_c=10.0",
        "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.name=sglang",
        "actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.multi_turn.enable=True",
        "actor_rollout_ref.rollout.multi_turn.max_user_turns=16",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=16",
        "actor_rollout_ref.rollout.multi_turn.tool_config_path=recipe/retool/sandbox_fusion_tool_config.yaml",
        "actor_rollout_ref.rollout.multi_turn.format=hermes", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.val_kwargs.top_p=0.6", "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        "actor_rollout_ref.rollout.val_kwargs.n=2", "trainer.logger=['console','jsonl']",
        "trainer.project_name=sglang-dapo-multiturn", "trainer.experiment_name=retool", "trainer.n_gpus_per_node=1",
        "trainer.val_before_train=True", "trainer.nnodes=1", "trainer.save_freq=-1", "trainer.test_freq=20",
        "trainer.total_epochs=1", "trainer.total_training_steps=2", f"trainer.output_dir={folder / 'out'}",
        f"trainer.default_local_dir={folder / 'ckpt'}", "trainer.progress_bar=false")
    assert got.returncode == 0, got.stderr[-3000:] + got.stdout[-3000:]
    rows = [json.loads(line) for line in next((folder / "out").glob("*/logs/metrics.jsonl")).read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(-1.0 <= r["reward/mean"] <= 1.0 for r in steps), steps
