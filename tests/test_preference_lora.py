"""LoRA in reward/cost-model and DPO training: only the adapters (and a scorer's head) change, the saved folder is a
plain model with the adapters folded in (or peft's adapter folder), and LoRA's mistakes are one line each."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alignrl.preference.cli import dpo_main, rm_main

REPO = Path(__file__).resolve().parents[1]
LORA = ["use_lora=true", "lora_rank=4", "lora_alpha=8", "lora_dropout=0", "lora_target_modules=[q_proj,v_proj]"]
TINY = ["max_train_pairs=8", "max_eval_pairs=8", "batch_size=8", "eval_batch_size=16", "report_to=[jsonl]",
        "learning_rate=1e-2", "warmup_ratio=0"]


def _rm(tmp: Path, model: Path, task: str, *extra: str) -> Path:
    out = tmp / f"{task}_rm"
    assert rm_main(["--config", str(REPO / "configs/rm_config.yaml"), "--task", task, "--output_dir", str(out),
                    "--logging_dir", str(tmp / f"logs_{task}"), f"model_path={model}", *TINY, *LORA, *extra]) == 0
    return out


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    adapter = folder / "adapter_model.safetensors"
    return load_file(str(adapter if adapter.exists() else folder / "model.safetensors"))


@pytest.fixture(scope="module")
def lora_scorers(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_rms")
    return _rm(tmp, tiny_model_dir, "helpful"), _rm(tmp, tiny_model_dir, "harmless")


def test_reward_model_lora_trains_adapters_and_head_only(lora_scorers, tiny_model_dir):
    from alignrl.models.value import ModelScorer
    from alignrl.preference.rm import load_score_model

    helpful, harmless = lora_scorers
    base, _ = load_score_model(str(tiny_model_dir), 42)  # the seeded head the run started from
    start = base.state_dict()
    for folder in (helpful, harmless):
        saved = _tensors(folder)
        assert set(saved) <= set(start) and not any("lora_" in k or "modules_to_save" in k for k in saved)
        changed = {k for k, v in saved.items() if not torch.equal(v, start[k])}
        assert "score.weight" in changed  # the head trains in full
        targeted = {k for k in saved if k.endswith(("q_proj.weight", "v_proj.weight"))}
        assert changed - {"score.weight"} == targeted  # every adapted weight moved, nothing else did
        assert ModelScorer(str(folder)).model is not None  # a plain scorer folder, as the RL loop loads it
    assert json.loads((harmless / "eval_results.json").read_text())["model_type"] == "cost"


def test_dpo_lora_trains_adapters_only_and_saves_a_plain_policy(lora_scorers, tiny_model_dir, tmp_path):
    from alignrl.models.loader import load_model

    helpful, harmless = lora_scorers
    out = tmp_path / "aligned"
    assert dpo_main(["--config", str(REPO / "configs/dpo_config.yaml"), "--output_dir", str(out), "--logging_dir",
                     str(tmp_path / "logs"), f"model_path={tiny_model_dir}", f"helpful_rm={helpful}",
                     f"harmless_rm={harmless}", "gradient_accumulation_steps=1", "kl_coeff=0.05", "log_every=1",
                     "eval_steps=1", *TINY, *LORA]) == 0
    policy, _ = load_model(str(out))  # what the RL loop and `alignrl demo` load
    start, saved = _tensors(tiny_model_dir), _tensors(out)
    changed = {k for k, v in saved.items() if k in start and not torch.equal(v, start[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed), changed
    res = json.loads((out / "eval_results.json").read_text())
    assert res["use_lora"] and res["loss_type"] == "safe_mm_dpo" and res["after"]["all"]["reward_margin"] != 0
    lam = json.loads((out / "safe_mm_dpo_state.json").read_text())
    assert lam["updates"] == res["steps"] and lam["lambda"] == res["lambda_final"]
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kl_divergence"] == 0.0 and rows[0]["loss_kl"] == 0.0  # the adapters start at zero: π = π_ref
    steps = [r for r in rows if "lambda" in r]
    assert steps[-1]["lambda"] == pytest.approx(lam["lambda"])
    assert "eval/reward_accuracy" in steps[0] and "eval/reward_accuracy" not in steps[-1]  # eval_steps=1: mid-run
    # the first update: ln λ = ln 1 + λ_lr·1·J, J the first step's expected cost (cost_threshold 0)
    assert steps[0]["lambda"] == pytest.approx(math.exp(0.01 * steps[0]["expected_cost"]), rel=1e-9)


def test_adapter_export_holds_the_adapters_and_the_head(tiny_model_dir, tmp_path):
    out = _rm(tmp_path, tiny_model_dir, "helpful", "lora_export=adapter", "max_steps=1")
    from safetensors.torch import load_file

    names = set(load_file(str(out / "adapter_model.safetensors")))
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    assert names and all("lora_" in n or ".score." in n for n in names), names


def test_folded_state_is_peft_merge_and_the_optimizer_holds_adapters_only(tiny_model_dir):
    from transformers import AutoModelForSequenceClassification

    from alignrl.models.lora import lora_spec, merged_state_dict
    from alignrl.preference.adapters import attach
    from alignrl.runtime.env import DistEnv
    from alignrl.train.engines import OptimSpec, build_engine

    spec = lora_spec(4, 8, 0.0, ["q_proj", "v_proj"])
    torch.manual_seed(0)
    model = attach(AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1), spec,
                   "SEQ_CLS", seed=0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)  # nonzero B and a changed head
    ours = merged_state_dict(model)
    inner = merged_state_dict(model, model.get_base_model().state_dict())  # as the reward trainer's engine holds it
    assert list(inner) == list(ours) and all(torch.equal(inner[k], v) for k, v in ours.items())
    engine = build_engine("single", model, OptimSpec(), DistEnv())
    held = sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"])
    assert held == sum(p.numel() for p in model.parameters() if p.requires_grad) < 0.2 * sum(
        p.numel() for p in model.parameters())
    peft_merged = model.merge_and_unload().state_dict()
    assert set(ours) == set(peft_merged)
    for k, v in peft_merged.items():
        assert torch.allclose(ours[k], v, atol=1e-6), k


# ---------------------------------------------------------------- one line each


def test_lora_without_peft_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    assert rm_main(["--task", "helpful", "use_lora=true"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("alignrl: error: use_lora: LoRA needs the peft package, which is not installed; "
                           "`pip install peft` (or train all weights: use_lora=false)")


def test_a_target_module_that_matches_nothing_is_one_line(tiny_model_dir, tmp_path, capsys):
    assert rm_main(["--task", "helpful", "--output_dir", str(tmp_path / "rm"), "--logging_dir", str(tmp_path / "l"),
                    f"model_path={tiny_model_dir}", *TINY, "use_lora=true", "lora_target_modules=[wq_proj]"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("alignrl: error: LoRA target_modules: wq_proj matches no module of this model; its "
                          "linear layers are named ") and "q_proj" in err and "\n" not in err
    assert not (tmp_path / "rm").exists()


@pytest.mark.slow
@pytest.mark.parametrize("task", ["rm", "dpo"])
def test_lora_trains_the_same_on_fsdp2_deepspeed_and_one_process(task, tiny_model_dir, tmp_path):
    """A reward model (adapters + score head) and a DPO policy (adapters; the reference is the policy with them off):
    two fsdp2 ranks and two deepspeed ranks give the losses and saved weights of one process accumulating the same
    global batches (one thread everywhere: the same float sums). DPO's did not while each rank drew its adapters
    from its own random state; the adapter folder was the ranks' shards (empty tensors under ZeRO-3)."""
    import os
    import sys

    from conftest import run_group

    # the reward model saves peft's adapter folder: written from the gathered state, not the ranks' shards
    what = (["rm", "--task", "helpful", "max_train_pairs=32", "lora_export=adapter"] if task == "rm" else
            ["dpo", "loss_type=sigmoid", "max_train_pairs=16", "learning_rate=1e-3"])
    common = ["max_eval_pairs=8", "batch_size=4", "log_every=1", *LORA, "report_to=[jsonl]",
              f"model_path={tiny_model_dir}"]
    losses, weights = {}, {}

    def read(strategy: str, out: Path, logs: Path) -> None:
        losses[strategy] = [r["loss"] for r in map(json.loads, (logs / "metrics.jsonl").read_text().splitlines())
                            if "loss" in r]
        weights[strategy] = _tensors(out)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # one process: batch 4 x 2 accumulation steps = two ranks' 4 x 2
        main = rm_main if task == "rm" else dpo_main
        assert main([*what[1:], "--output_dir", str(tmp_path / "one"), "--logging_dir", str(tmp_path / "logs_one"),
                     *common, "strategy=single", "gradient_accumulation_steps=2"]) == 0
    finally:
        torch.set_num_threads(threads)
    read("one", tmp_path / "one", tmp_path / "logs_one")
    # the reward model on DeepSpeed alone (its adapter folder gathered from the ranks' shards); fsdp2's is DPO's
    strategies = ("fsdp2", "deepspeed") if task == "dpo" else ("deepspeed",)
    for strategy in strategies:
        out, logs = tmp_path / strategy, tmp_path / f"logs_{strategy}"
        p = run_group([sys.executable, "-m", "alignrl", "train", what[0], "--nproc", "2", *what[1:],
                       "--output_dir", str(out), "--logging_dir", str(logs), *common, f"strategy={strategy}",
                       "gradient_accumulation_steps=1"], 240,
                      env={**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": "60"})
        assert p.returncode == 0, p.stderr[-3000:]
        read(strategy, out, logs)
    assert len(losses["one"]) == 4 and len(set(losses["one"])) > 1, losses["one"]  # it trained: the loss moved
    for strategy in strategies:
        assert losses[strategy] == pytest.approx(losses["one"], rel=1e-5)
        assert weights[strategy].keys() == weights["one"].keys()
        assert all(torch.allclose(weights[strategy][k], weights["one"][k], atol=1e-6) for k in weights["one"])


def test_a_policy_passed_as_a_reward_model_is_one_line(tiny_model_dir, tmp_path, capsys):
    harmless = tmp_path / "harmless_rm"
    harmless.mkdir()
    (harmless / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForSequenceClassification"]}))
    assert dpo_main(["--config", str(REPO / "configs/dpo_config.yaml"), f"helpful_rm={tiny_model_dir}",
                     f"harmless_rm={harmless}", "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"alignrl: error: helpful_rm={tiny_model_dir} is a Qwen2ForCausalLM, "
                   "a policy, not a reward model: it has no scoring head; train one with `bash "
                   "scripts/train_rm_distributed.sh helpful <NGPU>` and point helpful_rm there")


def test_a_dpo_run_resumed_from_its_checkpoint_ends_where_the_whole_run_does(lora_scorers, tiny_model_dir, tmp_path,
                                                                              capsys):
    """With LoRA's dropout on: the resumed run draws the masks the whole run drew (keyed by the micro-batch)."""
    helpful, harmless = lora_scorers
    base = ["--config", str(REPO / "configs/dpo_config.yaml"), f"model_path={tiny_model_dir}", f"helpful_rm={helpful}",
            f"harmless_rm={harmless}", "gradient_accumulation_steps=1", "lambda_lr=0.5", "log_every=1", *TINY, *LORA,
            "lora_dropout=0.1"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert dpo_main([*base, "--output_dir", str(whole), "--logging_dir", str(tmp_path / "l1"), "save_steps=1"]) == 0
    ckpt = tmp_path / "whole.checkpoints" / "step_1"
    assert sorted(p.name for p in ckpt.iterdir()) == ["optim.pt", "state.json", "weights.safetensors"]
    saved = load_file(ckpt / "weights.safetensors")  # the trained tensors only: the base is the model folder's
    assert saved and all("lora_" in k for k in saved), sorted(saved)[:5]
    assert not (tmp_path / "whole.checkpoints" / "step_2").exists()  # the last step is the saved model itself
    assert dpo_main([*base, "--output_dir", str(resumed), "--logging_dir", str(tmp_path / "l2"),
                     f"resume_from={ckpt}"]) == 0
    a, b = (json.loads((d / "safe_mm_dpo_state.json").read_text()) for d in (whole, resumed))
    assert a["updates"] == b["updates"] == 2 and b["lambda"] == pytest.approx(a["lambda"], rel=1e-9)
    wa, wb = _tensors(whole), _tensors(resumed)
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)
    rows = [json.loads(line) for line in (tmp_path / "l2" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "lambda" in r] == [2]  # only the step after the checkpoint ran
    # adapters on other modules than the checkpoint's (a LoRA default that changed between runs): the modules to name
    capsys.readouterr()
    assert dpo_main([*base, "lora_target_modules=all-linear", "--output_dir", str(tmp_path / "other"),
                     "--logging_dir", str(tmp_path / "l3"), f"resume_from={ckpt}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "its LoRA adapters are on q_proj,v_proj and this run's on " in err, err
    assert err.endswith("resume naming them: lora_target_modules=q_proj,v_proj (TRL's --lora_target_modules q_proj "
                        "v_proj, OpenRLHF's --target_modules q_proj v_proj)"), err


def test_resuming_from_a_folder_that_is_no_checkpoint_is_one_line(lora_scorers, tiny_model_dir, tmp_path, capsys):
    helpful, harmless = lora_scorers
    assert dpo_main(["--output_dir", str(tmp_path / "out"), "--logging_dir", str(tmp_path / "l"),
                     f"model_path={tiny_model_dir}", f"helpful_rm={helpful}", f"harmless_rm={harmless}",
                     f"resume_from={tmp_path}", *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"alignrl: error: resume_from={tmp_path} is not a checkpoint of `alignrl train dpo` (no "
                   "weights.safetensors and state.json); give a checkpoint folder (step_<N>, checkpoint-<N> or "
                   "global_step_<N>)")
