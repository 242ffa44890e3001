"""Code rewards: the local runner's limits, verl's code extraction and test cases, and `alignrl serve sandbox`
(SandboxFusion's /run_code) as a real subprocess reached by the sandbox client."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from alignrl.rewards import code
from alignrl.rewards.code_exec import FINISHED, TIME_LIMIT, LocalRunner
from alignrl.rewards.errors import RewardError
from alignrl.rewards.registry import default_compute_score, ground_truth_problem, load_reward_fn
from alignrl.rewards.sandbox_client import SandboxClient, endpoint
from alignrl.serve.sandbox import Limits, create_app

REPO = Path(__file__).resolve().parents[1]
RUNNER = LocalRunner()
ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
CASES = json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]})


def test_runner_reads_stdin_and_reports_exit_codes():
    ok = RUNNER.run("print(int(input()) * 2)", "21\n")
    assert (ok.status, ok.return_code, ok.stdout, ok.succeeded) == (FINISHED, 0, "42\n", True)
    failed = RUNNER.run("import sys\nprint('x')\nsys.exit(3)")
    assert (failed.status, failed.return_code, failed.stdout, failed.succeeded) == (FINISHED, 3, "x\n", False)


def test_runner_traceback_names_only_the_program():
    r = RUNNER.run("def f():\n    raise ValueError('boom')\nf()")
    assert r.return_code == 1 and r.stderr.startswith("Traceback") and 'File "main.py", line 2' in r.stderr
    assert "runpy" not in r.stderr and r.stderr.rstrip().endswith("ValueError: boom")


def test_runner_limits_memory_time_and_output():
    assert "MemoryError" in RUNNER.run("x = bytearray(2 << 30)", memory_mb=256).stderr
    assert RUNNER.run("while True:\n    pass", timeout_s=1).status == TIME_LIMIT
    flood = RUNNER.run("while True:\n    print('x' * 1000)", timeout_s=60)
    assert flood.status == FINISHED and not flood.succeeded  # the output cap ended it, not the clock
    assert len(flood.stdout) <= 1 << 20


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"  # killed, waiting for init to reap it


def test_runner_kills_what_the_program_started():
    r = RUNNER.run("import subprocess\np = subprocess.Popen(['sleep', '300'])\nprint(p.pid, flush=True)\n"
                   "while True:\n    pass", timeout_s=2)
    assert r.status == TIME_LIMIT
    pid = int(r.stdout.split()[0])
    deadline = time.monotonic() + 60
    while not _gone(pid):
        assert time.monotonic() < deadline, "the program's child outlived its run"
        time.sleep(0.1)


def test_runner_refuses_other_languages():
    r = RUNNER.run("int main(){}", language="cpp")
    assert r.status == "Error" and "python only" in r.stderr


def test_extract_code_follows_verl():
    assert code.extract_code("a\n```python\nx=1\n```\nthen\n```python\ny=2\n```") == "\ny=2\n"
    assert code.extract_code("```py\nprint(1)\n```") == "print(1)\n"
    assert code.extract_code("```\nprint(1)\n```") == "\nprint(1)\n"
    assert code.extract_code("print(1)") == "print(1)"


@pytest.mark.parametrize("truth, words", [
    ("not json", "not JSON"), ({"inputs": [1]}, "inputs"), ({"inputs": [1], "outputs": [1, 2]}, "1 inputs but 2"),
    ({"inputs": [], "outputs": []}, "no test cases"), ({"inputs": [1], "outputs": [1], "fn_name": "a b"}, "fn_name")])
def test_bad_test_cases_are_named(truth, words):
    with pytest.raises(ValueError, match=words):
        code.parse_cases(truth)
    assert words in ground_truth_problem("codecontests", truth)


def test_stdin_cases_score_the_pass_rate():
    assert default_compute_score("codecontests", f"Sum:\n{ADD}", CASES) == 1.0
    assert default_compute_score("apps", "```python\nprint(3)\n```", CASES) == 0.5
    assert default_compute_score("codeforces", "```python\nprint(int(input())\n```", CASES) == 0.0
    assert ground_truth_problem("taco", CASES) is None


def test_outputs_compare_line_by_line_without_trailing_spaces():
    truth = {"inputs": [""], "outputs": ["1 2 \n3\n"]}
    assert default_compute_score("codecontests", "print('1 2')\nprint('3  ')\nprint()", truth) == 1.0
    assert default_compute_score("codecontests", "print('1  2')\nprint(3)", truth) == 0.0  # inner spaces count


def test_only_the_first_ten_cases_count():
    truth = {"inputs": [str(i) for i in range(12)], "outputs": [str(i) for i in range(10)] + ["x", "y"]}
    assert default_compute_score("taco", "print(input())", truth) == 1.0


def test_call_cases_call_the_function_or_solution_method():
    truth = json.dumps({"inputs": [[1, 2], [5, 5]], "outputs": [[3], [10]], "fn_name": "add"})
    method = "```python\nclass Solution:\n    def add(self, a, b):\n        return a + b\n```"
    assert default_compute_score("taco", method, truth) == 1.0
    assert default_compute_score("taco", "def add(a, b):\n    return a + b if a < 5 else 0", truth) == 0.5


def test_sandbox_app_answers_in_sandbox_fusion_form():
    client = TestClient(create_app(RUNNER, Limits(max_timeout_s=5, workers=1)))
    r = client.post("/run_code", json={"code": "print(input())", "stdin": "hi", "language": "python"})
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "Success" and body["run_result"]["stdout"] == "hi\n"
    assert body["run_result"]["status"] == FINISHED and body["compile_result"] is None
    failed = client.post("/run_code", json={"code": "raise SystemExit(2)"}).json()
    assert failed["status"] == "Failed" and failed["run_result"]["return_code"] == 2


@pytest.mark.parametrize("body, words", [
    (b"{", "not valid JSON"), (b"[]", "JSON object"), (b'{"code": 1}', "'code' must be a string"),
    (b'{"code": "", "language": "cpp"}', "python only"), (b'{"code": "", "run_timeout": -1}', "positive"),
    (b'{"code": "", "files": {"a": "b"}}', "not supported")])
def test_sandbox_app_refuses_bad_requests_in_one_line(body, words):
    client = TestClient(create_app(RUNNER))
    r = client.post("/run_code", content=body, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500
    message = r.json()["error"]["message"]
    assert words in message and "\n" not in message


def test_a_request_cannot_lift_the_memory_limit():
    from alignrl.serve.sandbox import parse_request

    assert parse_request(b'{"code": "", "memory_limit_MB": 0.5}', Limits()).memory_mb == 1
    assert parse_request(b'{"code": "", "memory_limit_MB": 99999}', Limits()).memory_mb == Limits().max_memory_mb


def test_sandbox_urls():
    assert endpoint("http://127.0.0.1:8080") == "http://127.0.0.1:8080/run_code"
    assert endpoint("https://x.example/run_code") == "https://x.example/run_code"
    with pytest.raises(RewardError, match="not an http"):
        endpoint("127.0.0.1:8080")


def test_dead_sandbox_is_one_line():
    from alignrl.runtime.ports import free_port

    port = free_port()  # from the test run's pool: free, and given to no other test
    with pytest.raises(RewardError, match=r"cannot reach it.*alignrl serve sandbox"):
        SandboxClient(f"http://127.0.0.1:{port}", retries=1).run("print(1)")


@pytest.fixture(scope="module")
def sandbox_url(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sandbox")
    out, err = (tmp / "stdout.txt").open("w"), (tmp / "stderr.txt").open("w")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "alignrl", "serve", "sandbox", "--port", "0", "--workers", "2"],
                            cwd=REPO, env=env, stdout=out, stderr=err)
    try:
        deadline = time.monotonic() + 120
        while not (m := re.search(r"ready on (http://127\.0\.0\.1:\d+/run_code)", (tmp / "stdout.txt").read_text())):
            assert proc.poll() is None, (tmp / "stderr.txt").read_text()[-2000:]
            assert time.monotonic() < deadline, "sandbox server not ready in 120 s"
            time.sleep(0.1)
        yield m.group(1)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()
        err.close()


def test_code_reward_through_the_sandbox_service(sandbox_url):
    client = SandboxClient(sandbox_url)
    r = client.run("print(input()[::-1])", "abc")
    assert (r.status, r.return_code, r.stdout) == (FINISHED, 0, "cba\n")
    assert client.run("while True:\n    pass", timeout_s=1).status == TIME_LIMIT
    reward = load_reward_fn(None, code_reward=code.CodeReward(client, code.CodeSettings(timeout_s=5)))
    assert reward("codecontests", ADD, CASES) == 1.0
    assert reward("apps", "```python\nprint(3)\n```", CASES) == 0.5
    assert reward("gsm8k", "#### 4", "4") == 1.0  # the other rules are as before


def test_verl_code_tool_runs_programs_on_the_sandbox(sandbox_url):
    import asyncio

    from alignrl.rollout.verl_code_tool import NOT_FINISHED, SandboxFusionTool

    tool = SandboxFusionTool({"sandbox_fusion_url": sandbox_url, "default_timeout": 5}, None)

    async def episode() -> list:
        instance, _ = await tool.create()
        texts = [(await tool.execute(instance, {"code": code, **extra}))[0].text for code, extra in (
            ("print(6 * 7)", {}), ("print('a')\nraise ValueError('b')", {}), ("while True:\n    pass", {"timeout": 1}))]
        kept = await tool.calc_reward(instance)
        await tool.release(instance)
        return texts, kept

    texts, kept = asyncio.run(episode())
    assert texts[0] == "42\n" and texts[1].startswith("a\nTraceback") and "ValueError: b" in texts[1]
    assert texts[2] == NOT_FINISHED and kept == texts


def test_verl_code_tool_needs_a_url_and_a_live_service():
    import asyncio

    from alignrl.errors import ConfigError
    from alignrl.rollout.remote import ServiceError
    from alignrl.rollout.verl_code_tool import SandboxFusionTool
    from alignrl.runtime.ports import free_port

    with pytest.raises(ConfigError, match="needs config.sandbox_fusion_url.*alignrl serve sandbox"):
        SandboxFusionTool({}, None)
    port = free_port()
    tool = SandboxFusionTool({"sandbox_fusion_url": f"http://127.0.0.1:{port}"}, None)
    tool.client.retries = 1
    with pytest.raises(ServiceError, match="cannot reach it"):
        asyncio.run(tool.execute("x", {"code": "print(1)"}))


def _code_rows(n: int) -> list[dict]:
    """verl's code layout (PRIME's Eurus data): chat prompt, a code data_source, test cases as JSON text."""
    cases = json.dumps({"inputs": ["2 3\n"], "outputs": ["5\n"]})
    return [{"data_source": "codecontests", "ability": "code",
             "prompt": [{"role": "user", "content": f"Write a program that adds two numbers. ({i})"}],
             "reward_model": {"ground_truth": cases, "style": "rule"}, "extra_info": {"index": i}} for i in range(n)]


def test_verls_sandbox_fusion_script_scores_code_on_the_sandbox(tiny_model_dir, tmp_path, cli_in_process,
                                                                http_servers, monkeypatch):
    """examples/ppo_trainer/run_deepseek7b_llm_sandbox_fusion.sh as written (sizes cut to the tiny model): every
    program of the two PPO steps and the held-out passes runs on the service at reward_model.sandbox_fusion_url, a
    stand-in here that passes every run, so the logged scores are all 1."""
    import http.server
    import threading

    import pyarrow as pa
    import pyarrow.parquet as pq

    from conftest import json_reply

    runs, lock = [], threading.Lock()

    class Sandbox(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            with lock:
                runs.append((self.path, body["stdin"], body["language"]))
            json_reply(self, {"status": "Success", "run_result": {"status": "Finished", "return_code": 0,
                                                                  "stdout": "5\n", "stderr": "",
                                                                  "execution_time": 0.01}})

        def log_message(self, *args):
            pass

    url = http_servers(Sandbox) + "/run_code"
    monkeypatch.chdir(tmp_path)
    pq.write_table(pa.Table.from_pylist(_code_rows(8)), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(_code_rows(4)), tmp_path / "test.parquet")
    got = cli_in_process(
        "train", "ppo", f"reward_model.sandbox_fusion_url={url}", "reward_model.reward_manager=prime",
        "algorithm.adv_estimator=gae", "data.train_files=train.parquet", "data.val_files=test.parquet",
        "data.train_batch_size=2", "data.max_prompt_length=64", "data.max_response_length=8",
        "data.filter_overlong_prompts=True", "data.truncation='error'",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.n=2", "critic.optim.lr=1e-5",
        f"critic.model.path={tiny_model_dir}", "critic.ppo_micro_batch_size_per_gpu=2",
        "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0", "trainer.logger=['console','jsonl']",
        "trainer.project_name='verl_example_gsm8k'", "trainer.experiment_name='code'", "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1", "trainer.save_freq=100", "trainer.test_freq=-1", "trainer.total_epochs=1",
        "trainer.total_training_steps=2", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        f"trainer.output_dir={tmp_path / 'out'}", "trainer.progress_bar=false")
    assert got.returncode == 0, got.stderr[-3000:] + got.stdout[-3000:]
    rows = [json.loads(line) for line in
            next((tmp_path / "out").glob("*/logs/metrics.jsonl")).read_text().splitlines()]
    scores = [r[k] for r in rows for k in ("reward/mean", "val/accuracy") if k in r]
    assert len(scores) == 3 and all(s == 1.0 for s in scores), rows  # the held-out pass before step 1, two steps
    assert len(runs) >= 2 * 2 * 2 and {r for r in runs} == {("/run_code", "2 3\n", "python")}


def test_the_sandbox_server_makes_itself_undumpable():
    """A process that is not dumpable has its /proc files (environ: ALIGNRL_API_KEY) owned by root, out of reach of
    the programs it runs as its own user; the kernel's flag is what is checked (PR_GET_DUMPABLE = 3)."""
    got = subprocess.run([sys.executable, "-c", "import ctypes\nfrom alignrl.serve.sandbox import _hide_environment\n"
                          "libc = ctypes.CDLL(None)\nbefore = libc.prctl(3, 0, 0, 0, 0)\n_hide_environment()\n"
                          "print(before, libc.prctl(3, 0, 0, 0, 0))"], capture_output=True, text=True, timeout=120)
    assert got.stdout.split() == ["1", "0"], got.stderr[-2000:]


class _Stub:
    """A stand-in service: /health with or without alignrl's header, /run_code answering `answers` in turn (an HTTP
    status, or a SandboxFusion body), recording each request's Authorization header."""

    def __init__(self, http_servers, answers, alignrl_health=False):
        import http.server

        from conftest import json_reply

        stub = self
        self.answers, self.auth = list(answers), []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                self.send_response(200)
                if alignrl_health:
                    self.send_header("X-Alignrl-Service", "sandbox")
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers["content-length"]))
                stub.auth.append(self.headers.get("Authorization"))
                answer = stub.answers.pop(0)
                if isinstance(answer, int):
                    json_reply(self, {"error": "busy"}, answer)
                else:
                    json_reply(self, answer)

            def log_message(self, *args):
                pass

        self.url = http_servers(Handler) + "/run_code"


FINISHED_BODY = {"status": "Success", "run_result": {"status": "Finished", "return_code": 0, "stdout": "ok\n",
                                                     "stderr": "", "execution_time": 0.0}}


def test_the_key_goes_to_alignrls_sandbox_only(http_servers, monkeypatch):
    monkeypatch.setenv("ALIGNRL_API_KEY", "k")
    other = _Stub(http_servers, [FINISHED_BODY])
    assert SandboxClient(other.url).run("print('ok')").stdout == "ok\n" and other.auth == [None]
    ours = _Stub(http_servers, [FINISHED_BODY], alignrl_health=True)
    SandboxClient(ours.url).run("print('ok')")
    assert ours.auth == ["Bearer k"]


def test_busy_answers_are_tried_again_and_a_sandbox_failure_is_one_line(http_servers):
    busy = _Stub(http_servers, [503, 502, FINISHED_BODY])
    assert SandboxClient(busy.url).run("print('ok')").stdout == "ok\n" and len(busy.auth) == 3
    failed = _Stub(http_servers, [{"status": "SandboxError", "message": "disk full", "run_result": None}])
    with pytest.raises(RewardError, match="failed to run a program .SandboxError: disk full"):
        SandboxClient(failed.url).run("print('ok')")
    refused = _Stub(http_servers, [401])
    with pytest.raises(RewardError, match="refused the request .401.: set ALIGNRL_API_KEY"):
        SandboxClient(refused.url).run("print('ok')")
