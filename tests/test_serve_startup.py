"""How the services start and refuse to: `alignrl serve generate|ref|reward` and the seed's launchers
(launch_vllm.py, launch_ref_model.py) refuse an open host without a key, a missing vLLM, a context past the model's
and a bad device in one line each, say Ctrl-C in their own names, and serve the seed's endpoints."""

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from alignrl.serve.process import ServiceProcess

pytestmark = pytest.mark.timeout(240)


def _run_cli(args, env_extra=None, timeout=60):
    import os

    env = {k: v for k, v in os.environ.items() if k != "ALIGNRL_API_KEY"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "alignrl", "serve", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.mark.parametrize("service", ["generate", "ref", "reward"])
def test_non_loopback_without_key_refuses_to_start(service):
    p = _run_cli([service, "--model", "demo", "--host", "0.0.0.0", "--port", "0"])
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1
    assert "ALIGNRL_API_KEY" in lines[0] and "0.0.0.0" in lines[0]


def test_missing_vllm_is_one_line(tiny_model_dir, capsys):
    from alignrl.serve import generate

    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    assert generate.main(["--model", str(tiny_model_dir), "--engine", "vllm", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["alignrl serve generate: error: vllm is not installed; install it on a GPU machine or use "
                   "--engine hf"]


def test_a_context_longer_than_the_models_is_one_line(tiny_model_dir, capsys):
    """As vLLM refuses a max_model_len past the model's max_position_embeddings: positions it never saw."""
    import json

    from alignrl.serve import generate

    longest = json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    assert generate.main(["--model", str(tiny_model_dir), "--port", "0", "--max_model_len", str(longest + 1)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"alignrl serve generate: error: --max_model_len {longest + 1} is longer than the model's context "
                   f"of {longest} (max_position_embeddings in {tiny_model_dir / 'config.json'}); give at most "
                   f"{longest} or leave it out"], err
    assert generate.main(["--model", str(tiny_model_dir), "--max_model_len", "-5"]) == 2
    assert "--max_model_len -5 must be a positive context length" in capsys.readouterr().err


SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.mark.parametrize("script", ["launch_vllm.py", "launch_ref_model.py"])
def test_seed_launchers_refuse_open_host_without_key(script):
    import os

    env = {k: v for k, v in os.environ.items() if k != "ALIGNRL_API_KEY"}
    p = subprocess.run([sys.executable, str(SRC / script), "--model_path", "demo", "--port", "8000",
                        "--tensor_parallel_size", "8", "--host", "0.0.0.0"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert p.returncode == 2 and "ALIGNRL_API_KEY" in p.stderr.strip().splitlines()[-1]


def test_seed_launchers_say_ctrl_c_and_errors_in_one_line_in_their_own_names(tiny_model_dir):
    """Ctrl-C on launch_ref_model.py printed a 30-line asyncio traceback (the shim called the server directly), and
    a bad --model_path was said as model.path."""
    import signal

    from conftest import signal_after

    code, _, err = signal_after([sys.executable, str(SRC / "launch_ref_model.py"), "--model_path",
                                 str(tiny_model_dir), "--port", "0"], "listening", signal.SIGINT, timeout=30)
    assert code == 130 and err.strip() == "launch_ref_model.py: interrupted", err
    bad = subprocess.run([sys.executable, str(SRC / "launch_vllm.py"), "--model_path", "/nonexistent/x", "--port", "0",
                          "--engine", "hf"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "launch_vllm.py: error: --model_path '/nonexistent/x' is not a Hugging Face model folder (no config.json "
        "there); pass a local folder saved with save_pretrained"), bad.stderr


def test_seed_launchers_serve_the_seed_endpoints(tiny_model_dir):
    from alignrl.serve.process import start_all

    procs = [ServiceProcess(["--model_path", str(tiny_model_dir), "--tensor_parallel_size", "8"],
                            command=[sys.executable, str(SRC / script)])
             for script in ("launch_vllm.py", "launch_ref_model.py")]
    start_all(procs)
    try:
        for p in procs:
            assert httpx.get(p.url + "/health").json() == {"status": "healthy"}
        r = httpx.post(procs[0].url + "/v1/generate_tokens", json={"prompts": [[3, 4, 5]], "temperature": 0,
                                                                   "max_tokens": 12}, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()["outputs"][0]
        lp = httpx.post(procs[1].url + "/v1/logprobs", json={"prompts": [[3, 4, 5]], "responses": [out["token_ids"]]})
        # the reference model scores greedy tokens exactly as the generator sampled them (same weights)
        assert lp.json()["logprobs"][0] == pytest.approx(out["logprobs"], abs=1e-4)
        procs[1].log.seek(0)  # the seed's --tensor_parallel_size 8 is named as not used, not dropped silently
        assert "--tensor_parallel_size 8 not used" in procs[1].log.read().decode(errors="replace")
    finally:
        for p in procs:
            p.stop()


def test_every_server_takes_device_and_names_a_bad_one_in_one_line():
    """--device (auto: cuda when torch sees a GPU): the generation server's HF engine and the reward server ran
    on the CPU even on a GPU machine (launch_vllm.py without vLLM served a 7B model in float32 on the CPU)."""
    import torch

    from alignrl.serve import generate, ref, reward
    from alignrl.serve.common import check_args, device_of

    for server in (generate, ref, reward):
        args = server.parser().parse_args(["--model", "demo"])
        assert check_args(args) is None and device_of(args) == ("cuda" if torch.cuda.is_available() else "cpu")
        assert "is not a torch device" in check_args(server.parser().parse_args(["--model", "m", "--device", "gpu0"]))
    if not torch.cuda.is_available():
        said = check_args(ref.parser().parse_args(["--model", "m", "--device", "cuda:1"]))
        assert said == "--device cuda:1 but torch sees no CUDA GPU here; pass --device cpu (or auto)"
