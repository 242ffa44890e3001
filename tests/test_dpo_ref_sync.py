"""TR-DPO's reference syncing in `alignrl train dpo` (sync_ref_model, ref_model_mixup_alpha, ref_model_sync_steps):
the mix itself, the reference moving exactly at the sync steps in a tiny run (one process, and two gloo ranks on
DDP, FSDP2 and DeepSpeed ZeRO-3, whose copies stay identical), the combinations refused in one line, and a resumed run that ends where the
uninterrupted one does."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_group
from alignrl.core.ref_mix import mix_into_reference
from alignrl.preference import ref_sync
from alignrl.preference.cli import dpo_main, parse_dpo
from alignrl.config import ConfigError

ALPHA = 0.6
# 8 pairs of each of the two train files in micro-batches of 4, one per optimizer step: four steps, synced after
# steps 2 and 4
TINY = ["loss_type=sigmoid", "max_train_pairs=8", "max_eval_pairs=4", "batch_size=4", "eval_batch_size=8",
        "gradient_accumulation_steps=1", "learning_rate=1e-2", "warmup_ratio=0", "log_every=1", "report_to=[jsonl]",
        "gradient_checkpointing=false", "bf16=false", "sync_ref_model=true", f"ref_model_mixup_alpha={ALPHA}",
        "ref_model_sync_steps=2"]


def _argv(model: Path, tmp: Path, name: str, *extra: str) -> list[str]:
    return [f"model_path={model}", "--output_dir", str(tmp / name), "--logging_dir", str(tmp / f"logs_{name}"),
            *TINY, *extra]


# ---------------------------------------------------------------- the mix


def test_alpha_one_copies_the_policy_exactly():
    ref, pol = torch.randn(5, 3), torch.randn(5, 3) * 1e6
    mix_into_reference([ref], [pol], 1.0)
    assert torch.equal(ref, pol)


def test_alpha_point_six_gives_the_known_numbers_in_place():
    ref, pol = torch.tensor([1.0, 2.0, -4.0]), torch.tensor([3.0, 4.0, 1.0])
    same = ref
    mix_into_reference([ref], [pol], 0.6)
    assert same is ref and torch.allclose(ref, torch.tensor([2.2, 3.2, -1.0]), atol=1e-6)
    assert torch.equal(pol, torch.tensor([3.0, 4.0, 1.0]))  # the policy is only read


def test_a_bf16_reference_stays_bf16_and_is_rounded_once():
    ref = torch.tensor([1.0, 3.0], dtype=torch.bfloat16)
    pol = torch.tensor([1.00390625, 3.0078125])  # fp32 policy weights a bf16 step apart from the reference
    mix_into_reference([ref], [pol], 0.6)
    assert ref.dtype == torch.bfloat16
    assert torch.equal(ref, (0.4 * torch.tensor([1.0, 3.0]) + 0.6 * pol).to(torch.bfloat16))


def test_the_mix_refuses_unpaired_tensors():
    with pytest.raises(ValueError, match="shape"):
        mix_into_reference([torch.zeros(2)], [torch.zeros(3)], 0.5)
    with pytest.raises(ValueError, match="1 reference tensors but 2 policy"):
        mix_into_reference([torch.zeros(2)], [torch.zeros(2), torch.zeros(2)], 0.5)


# ---------------------------------------------------------------- the config


@pytest.mark.parametrize("argv, expect", [
    (["sync_ref_model=true", "precompute_ref_log_probs=true"],
     "sync_ref_model moves the reference during training, so log-probs precomputed up front would go stale; set "
     "precompute_ref_log_probs=false or sync_ref_model=false"),
    (["--sync_ref_model", "use_lora=true"],
     "sync_ref_model with use_lora: the reference is the policy with its adapters off, no copy that could move; give "
     "ref_model_path (a folder other than model_path) or set use_lora=false"),
    (["--sync_ref_model", "--ref_model_mixup_alpha", "0"], "ref_model_mixup_alpha"),
    (["--sync_ref_model", "ref_model_mixup_alpha=1.5"], "ref_model_mixup_alpha"),
    (["--sync_ref_model", "--ref_model_sync_steps", "0"], "ref_model_sync_steps"),
], ids=["precompute", "lora_adapters_off_reference", "alpha_zero", "alpha_above_one", "sync_steps_zero"])
def test_combinations_that_cannot_work_are_one_line_before_any_model_loads(argv, expect, capsys, monkeypatch):
    monkeypatch.setattr("alignrl.models.loader.load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    assert dpo_main(["loss_type=sigmoid", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("alignrl: error: ") and expect in err and "\n" not in err, err


def test_the_keys_and_trl_flags_parse_and_unused_settings_are_said(capsys):
    cfg = parse_dpo(["--sync_ref_model", "--ref_model_mixup_alpha", "0.9", "--ref_model_sync_steps", "64"])
    assert (cfg.sync_ref_model, cfg.ref_model_mixup_alpha, cfg.ref_model_sync_steps) == (True, 0.9, 64)
    cfg = parse_dpo([])
    assert (cfg.sync_ref_model, cfg.ref_model_mixup_alpha, cfg.ref_model_sync_steps) == (False, 0.6, 512)
    assert capsys.readouterr().err == ""
    cfg = parse_dpo(["ref_model_sync_steps=8"])  # accepted, but said: without sync_ref_model it changes nothing
    assert cfg.ref_model_sync_steps == 8 and not cfg.sync_ref_model
    assert capsys.readouterr().err.strip() == ("alignrl: note: ref_model_sync_steps=8 takes effect only with "
                                               "sync_ref_model=true; the reference stays fixed")
    parse_dpo(["ref_model_sync_steps=8", "ref_model_mixup_alpha=1"])
    assert capsys.readouterr().err.strip() == ("alignrl: note: ref_model_mixup_alpha=1.0 and ref_model_sync_steps=8 "
                                               "take effect only with sync_ref_model=true; the reference stays fixed")


# ---------------------------------------------------------------- tiny runs


def _recorder(seen: list, monkeypatch) -> None:
    """Wraps ReferenceSync.after_step: the reference before and after every step, and the policy's full weights."""
    original = ref_sync.ReferenceSync.after_step

    def record(self, step, engine):
        from alignrl.models.lora import merged_state_dict

        before = {n: p.detach().clone() for n, p in self.moving.params.items()}
        original(self, step, engine)
        full = engine.full_state_dict()
        full = merged_state_dict(self.lora_policy, full) if self.lora_policy is not None else full
        policy = {n: t.clone() for n, t in full.items() if n in self.moving.params}
        seen.append((step, before, {n: p.detach().clone() for n, p in self.moving.params.items()}, policy))

    monkeypatch.setattr(ref_sync.ReferenceSync, "after_step", record)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora_with_ref_model_path"])
def test_the_reference_moves_exactly_at_the_sync_steps_by_the_mix(lora, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """With LoRA and a reference of its own (ref_model_path), the policy mixed in has its adapters folded in."""
    seen: list = []
    _recorder(seen, monkeypatch)
    extra = []
    if lora:
        shutil.copytree(tiny_model_dir, tmp_path / "ref")
        extra = [f"ref_model_path={tmp_path / 'ref'}", "use_lora=true", "lora_rank=4", "lora_alpha=8",
                 "lora_dropout=0", "lora_target_modules=[q_proj,v_proj]"]
    assert dpo_main(_argv(tiny_model_dir, tmp_path, "run", "strategy=single", *extra)) == 0
    assert [s[0] for s in seen] == [1, 2, 3, 4]
    for step, before, after, policy in seen:
        if step % 2:
            assert all(torch.equal(before[n], after[n]) for n in before), step
            continue
        assert not all(torch.equal(before[n], after[n]) for n in before), step  # the policy had moved away
        for n in before:
            torch.testing.assert_close(after[n], ALPHA * policy[n] + (1 - ALPHA) * before[n], rtol=0, atol=1e-6)
    out = capsys.readouterr().out
    assert "step 2: reference ← 0.6·policy + 0.4·reference" in out and "step 4: reference" in out
    assert "step 1: reference" not in out and "step 3: reference" not in out


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_a_run_resumed_after_a_sync_ends_where_the_whole_run_does(tiny_model_dir, tmp_path, capsys):
    assert dpo_main(_argv(tiny_model_dir, tmp_path, "whole", "strategy=single", "save_steps=3")) == 0
    ckpt = tmp_path / "whole.checkpoints" / "step_3"
    assert sorted(p.name for p in ckpt.iterdir()) == ["optim.pt", "reference.safetensors", "state.json",
                                                      "weights.safetensors"]
    assert json.loads((ckpt / "state.json").read_text())["reference"] == {"moved_at": "2", "alpha": "0.6", "every": "2"}
    assert not list((tmp_path / "whole.checkpoints").glob(".*"))  # nothing half-written left beside it
    # without the synced reference the last step would train against the initial one: refused, not resumed
    assert dpo_main(_argv(tiny_model_dir, tmp_path, "plain", "strategy=single", "sync_ref_model=false",
                          f"resume_from={ckpt}")) == 2
    assert "holds a reference moved by sync_ref_model; resume with sync_ref_model=true" in capsys.readouterr().err
    assert dpo_main(_argv(tiny_model_dir, tmp_path, "resumed", "strategy=single", f"resume_from={ckpt}")) == 0
    whole, resumed = _weights(tmp_path / "whole"), _weights(tmp_path / "resumed")
    assert whole.keys() == resumed.keys()
    for k in whole:
        torch.testing.assert_close(resumed[k], whole[k], rtol=0, atol=1e-6)
    a, b = (json.loads((tmp_path / d / "eval_results.json").read_text())["after"]["all"] for d in ("whole", "resumed"))
    assert b["reward_margin"] == pytest.approx(a["reward_margin"], abs=1e-5)  # against the same final reference


RANK_SCRIPT = """
import os, sys
from safetensors.torch import save_file
from alignrl.preference import ref_sync
from alignrl.preference.cli import dpo_main

original = ref_sync.ReferenceSync.after_step


def record(self, step, engine):
    before = {"before." + n: p.detach().clone() for n, p in self.moving.params.items()}
    original(self, step, engine)
    if step % self.every == 0:
        policy = {"policy." + n: t.clone() for n, t in engine.full_state_dict().items() if n in self.moving.params}
        after = {"after." + n: p.detach().cpu().clone() for n, p in self.moving.params.items()}
        save_file({**before, **policy, **after}, f"{sys.argv[1]}/rank{os.environ['RANK']}_step{step}.safetensors")


ref_sync.ReferenceSync.after_step = record
sys.exit(dpo_main(sys.argv[2:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("engine", [["strategy=ddp"], ["strategy=fsdp2"], ["strategy=deepspeed", "zero_stage=3"]],
                         ids=["ddp", "fsdp2", "deepspeed_zero3"])
def test_two_ranks_mix_the_full_policy_into_identical_references(engine, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from alignrl.runtime.ports import free_port

    script, dumps = tmp_path / "record_sync.py", tmp_path / "dumps"
    script.write_text(RANK_SCRIPT)
    dumps.mkdir()
    p = run_group([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                   str(script), str(dumps), *_argv(tiny_model_dir, tmp_path, "two", *engine, "max_train_pairs=16")],
                  240,
                  env={**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": "60"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(f.name for f in dumps.iterdir()) == [f"rank{r}_step{s}.safetensors" for r in (0, 1) for s in (2, 4)]
    for step in (2, 4):
        r0, r1 = (load_file(str(dumps / f"rank{r}_step{step}.safetensors")) for r in (0, 1))
        assert r0.keys() == r1.keys()
        for k in r0:  # every rank holds the same reference, mixed from the same gathered policy
            assert torch.equal(r0[k], r1[k]), (step, k)
        for k in (k for k in r0 if k.startswith("after.")):
            name = k.removeprefix("after.")
            torch.testing.assert_close(r0[k], ALPHA * r0["policy." + name] + (1 - ALPHA) * r0["before." + name],
                                       rtol=0, atol=1e-6)
            assert r0["policy." + name].shape == r0[k].shape  # the full tensor, not a rank's shard


def test_trls_spellings_of_the_switches():
    assert parse_dpo(["--sync_ref_model", "True", "beta=0.2"]).sync_ref_model is True
    assert parse_dpo(["--sync_ref_model", "beta=0.2"]).sync_ref_model is True  # bare, before an override
    assert parse_dpo(["--sync_ref_model=false"]).sync_ref_model is False
    assert parse_dpo(["--precompute_ref_log_probs", "False"]).precompute_ref_log_probs is False
    with pytest.raises(ConfigError, match="--sync_ref_model takes true or false"):
        parse_dpo(["--sync_ref_model=maybe"])


def test_a_resume_with_another_mix_goes_on_from_the_saved_reference_and_says_so():
    from types import SimpleNamespace

    from alignrl.preference.ref_sync import ReferenceSync

    said, policy = [], torch.nn.Linear(2, 2)
    cfg = SimpleNamespace(ref_model_mixup_alpha=0.9, ref_model_sync_steps=8, ref_model_path="ref", model_path="pol")
    sync = ReferenceSync(cfg, torch.nn.Linear(2, 2), policy, SimpleNamespace(print=said.append))
    saved = {n: torch.full_like(p, 0.5) for n, p in policy.state_dict().items()}
    sync.load(saved, {"moved_at": "4", "alpha": "0.6", "every": "2"}, "ckpt")
    assert sync.synced_at == 4 and all(torch.equal(p, saved[n]) for n, p in sync.moving.params.items())
    assert said == ["the reference moved by alpha=0.6 every 2 optimizer steps until optimizer step 4; it moves by "
                    "alpha=0.9 every 8 optimizer steps from here"]
    with pytest.raises(ConfigError, match="its reference was saved from another model"):
        sync.load({"weight": saved["weight"]}, {"moved_at": "4"}, "ckpt")
