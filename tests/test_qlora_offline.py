"""QLoRA in the offline trainers (train sft, dpo, kto, the kd student: load_in_4bit with use_lora): the base loads as
bitsandbytes NF4 layers under the adapters, the runs train and resume, and the keys and flags that cannot go with a
4-bit base are one line each."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from alignrl.config import ConfigError

bnb = pytest.importorskip("bitsandbytes")

OFFLINE_QLORA = ["use_lora=true", "lora_rank=4", "lora_alpha=8", "lora_dropout=0", "load_in_4bit=true",
                 "report_to=[jsonl]", "warmup_ratio=0", "log_every=1", "learning_rate=1e-2"]
SFT_ROWS = [{"prompt": f"count from {i}", "completion": " ".join(str(i + k) for k in range(1 + i % 4))}
            for i in range(8)]


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _metrics(folder) -> list[dict]:
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


def _sft(model_dir, tmp, name, *extra) -> list[dict]:
    from alignrl.preference.sft_cli import sft_main

    rc = sft_main([f"model_path={model_dir}", f"train_files=[{_jsonl(tmp / 'rows.jsonl', SFT_ROWS)}]", "batch_size=2",
                   "max_steps=4", *OFFLINE_QLORA, "--output_dir", str(tmp / name), "--logging_dir",
                   str(tmp / f"logs_{name}"), *extra])
    assert rc == 0
    return _metrics(tmp / f"logs_{name}")


@pytest.fixture(scope="module")
def sft_4bit_run(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft_4bit")
    return tmp, _sft(tiny_model_dir, tmp, "whole", "save_steps=2")


def test_the_offline_trainers_load_a_4bit_base_under_the_adapters(tiny_model_dir):
    from types import SimpleNamespace

    from alignrl.preference import common as pc
    from alignrl.preference.sft_cli import parse_sft

    cfg = parse_sft([f"model_path={tiny_model_dir}", "train_files=[rows.jsonl]", *OFFLINE_QLORA])
    assert cfg.lora_export == "adapter"  # not given: with a 4-bit base the export is the adapter folder
    policy, model, spec = pc.trainable_causal_lm(cfg, tiny_model_dir, SimpleNamespace(print=print), "cpu")
    projections = [layer.self_attn.q_proj for layer in policy.model.layers]
    assert all(isinstance(p.get_base_layer(), bnb.nn.Linear4bit) for p in projections)
    assert all(p.get_base_layer().weight.dtype == torch.uint8 for p in projections)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable), trainable


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_a_4bit_sft_run_trains_and_saves_an_adapter_for_the_full_precision_base(sft_4bit_run, tiny_model_dir):
    from peft import PeftModel

    from alignrl.models.loader import load_model

    tmp, rows = sft_4bit_run
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    out = tmp / "whole"
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    trained = load_file(out / "adapter_model.safetensors")
    assert trained and all("lora_" in k for k in trained)
    base, _ = load_model(str(tiny_model_dir))
    model = PeftModel.from_pretrained(base, str(out))
    mine = {k.replace(".default", ""): v for k, v in model.named_parameters()}
    assert all(torch.equal(mine[k], v) for k, v in trained.items())
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())  # the base is full precision again


def test_a_resumed_4bit_sft_run_equals_the_whole_one(sft_4bit_run, tiny_model_dir):
    tmp, rows = sft_4bit_run
    saved = load_file(tmp / "whole.checkpoints" / "step_2" / "weights.safetensors")
    assert saved and all("lora_" in k for k in saved), sorted(saved)[:5]  # the packed 4-bit base is not written
    resumed = _sft(tiny_model_dir, tmp, "resumed", f"resume_from={tmp / 'whole.checkpoints' / 'step_2'}")
    assert [r["step"] for r in resumed if "train/loss" in r] == [3, 4]
    whole, again = (load_file(tmp / n / "adapter_model.safetensors") for n in ("whole", "resumed"))
    assert whole.keys() == again.keys()
    for k in whole:
        torch.testing.assert_close(whole[k], again[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("extra, said", [
    (["bnb_4bit_quant_type=fp4"], "was trained over a base quantized as load_in_4bit=True, load_in_8bit=False, "
                                  "bnb_4bit_quant_type=nf4"),
    (["load_in_4bit=false", "lora_export=adapter"], "and this run's is none: resume with the load_in_4bit"),
    (["lora_alpha=16"], "holds adapters of r=4, lora_alpha=8, use_rslora=False and this run's are r=4, lora_alpha=16"),
    (["lora_rank=8"], "holds adapters of r=4"),
    (["use_lora=false", "load_in_4bit=false"], "holds LoRA adapters and this run trains none: resume with "
                                               "use_lora=true"),
    (["other-base"], "holds adapters trained over other base weights than this run's: resume with the "
                     "model_path"),
])
def test_a_checkpoint_of_adapters_resumed_over_another_base_or_adapters_is_one_line(sft_4bit_run, tiny_model_dir,
                                                                                      capsys, extra, said):
    """The checkpoint holds the adapters alone: the base they trained over (its weights, its quantization) and their
    rank and scale are recorded, and a resume that differs stops before loading anything."""
    from alignrl.models.loader import load_model
    from alignrl.preference.sft_cli import sft_main

    tmp, _ = sft_4bit_run
    model_dir = tiny_model_dir
    if extra == ["other-base"]:  # the same shapes and names, other weights
        import shutil

        model_dir = tmp / "other_base"
        shutil.copytree(tiny_model_dir, model_dir, dirs_exist_ok=True)
        model, _ = load_model(str(tiny_model_dir))
        with torch.no_grad():
            model.model.layers[0].self_attn.q_proj.weight.add_(0.5)
        model.save_pretrained(str(model_dir))
        extra = []
    capsys.readouterr()
    rc = sft_main([f"model_path={model_dir}", f"train_files=[{tmp / 'rows.jsonl'}]", "batch_size=2", "max_steps=4",
                   *OFFLINE_QLORA, *extra, "--output_dir", str(tmp / "again"), "--logging_dir", str(tmp / "again_l"),
                   f"resume_from={tmp / 'whole.checkpoints' / 'step_2'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and any(said in line for line in err), err[-3:]


@pytest.mark.parametrize("extra", [[], ["precompute_ref_log_probs=true"]])
def test_a_4bit_dpo_run_trains_against_the_base_with_its_adapters_off(tiny_model_dir, tmp_path, capsys, extra):
    from alignrl.preference.cli import dpo_main

    rc = dpo_main([f"model_path={tiny_model_dir}", "loss_type=sigmoid", "max_train_pairs=4", "max_eval_pairs=4",
                   "batch_size=4", "eval_batch_size=8", "max_steps=2", *OFFLINE_QLORA, *extra, "--output_dir",
                   str(tmp_path / "dpo"), "--logging_dir", str(tmp_path / "logs")])
    out = capsys.readouterr().out
    assert rc == 0 and "base quantized to 4-bit NF4" in out and "the reference is the policy with its adapters off" in out
    rows = [r for r in _metrics(tmp_path / "logs") if "rewards/margin" in r]
    # the adapters start at zero: the policy is the reference exactly, on the same 4-bit base
    assert rows[0]["rewards/margin"] == 0.0 and rows[0]["dpo/loss"] == pytest.approx(math.log(2))
    assert rows[-1]["rewards/margin"] != 0.0 and rows[-1]["step"] == 2
    assert (tmp_path / "dpo" / "adapter_config.json").is_file()


def test_a_4bit_kto_run_trains_adapters(tiny_model_dir, tmp_path, capsys):
    from alignrl.preference.kto_cli import kto_main

    rows = [{"prompt": f"question {i}", "completion": "yes good" if k else "no bad", "label": bool(k)}
            for i in range(4) for k in (1, 0)]
    # the codes packed in float16, whose bytes read as floats are often NaN: the save must not take them for weights
    rc = kto_main([f"model_path={tiny_model_dir}", f"train_files=[{_jsonl(tmp_path / 'kto.jsonl', rows)}]",
                   "batch_size=4", *OFFLINE_QLORA, "bnb_4bit_quant_storage=float16", "--output_dir",
                   str(tmp_path / "kto"), "--logging_dir", str(tmp_path / "logs")])
    out = capsys.readouterr().out
    assert rc == 0 and "base quantized to 4-bit NF4" in out and "the reference is the policy with its adapters off" in out
    trained = load_file(tmp_path / "kto" / "adapter_model.safetensors")
    assert trained and all("lora_" in k for k in trained)


@pytest.mark.parametrize("parse, keys, words", [
    ("sft", ["use_lora=false"], "load_in_4bit=true quantizes the frozen base under LoRA adapters (QLoRA), and trains "
                                "nothing without them: set use_lora=true (TRL: --use_peft; OpenRLHF: --lora_rank 16)"),
    ("sft", ["strategy=fsdp2"], "strategy=fsdp2 shards the weights, and bitsandbytes' 4-bit weights do not shard"),
    ("kto", ["strategy=deepspeed"], "strategy=deepspeed shards the weights"),
    ("dpo", ["lora_export=merged"], "lora_export=merged folds the adapters into the base weights, which with "
                                    "load_in_4bit are 4-bit codes: set lora_export=adapter"),
    ("dpo", ["sync_ref_model=true", "ref_model_path=other", "loss_type=sigmoid"],
     "sync_ref_model moves the reference toward the policy's merged weights"),
    ("rm", [], "load_in_4bit=true: `alignrl train rm` loads a sequence classifier"),
])
def test_offline_keys_that_cannot_go_with_a_4bit_base_are_one_line(parse, keys, words):
    from alignrl.preference.cli import parse_dpo, parse_rm
    from alignrl.preference.kto_cli import parse_kto
    from alignrl.preference.sft_cli import parse_sft

    parsers = {"sft": parse_sft, "dpo": parse_dpo, "kto": parse_kto, "rm": parse_rm}
    with pytest.raises(ConfigError) as e:
        parsers[parse]([*OFFLINE_QLORA, *keys])
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_trl_and_openrlhf_load_in_4bit_on_the_offline_commands(capsys):
    from alignrl.preference.cli import parse_dpo
    from alignrl.preference.kto_cli import parse_kto
    from alignrl.preference.sft_cli import parse_sft

    trl = ["--model_name_or_path", "m", "--dataset_name", "d.jsonl"]
    openrlhf = ["--pretrain", "m", "--dataset", "d.jsonl"]
    for parse in (parse_sft, parse_dpo, parse_kto):  # TRL's ModelConfig: --use_peft --load_in_4bit
        cfg = parse([*trl, "--use_peft", "--lora_r", "4", "--load_in_4bit"])
        assert (cfg.use_lora, cfg.lora_rank, cfg.load_in_4bit, cfg.lora_export) == (True, 4, True, "adapter")
        assert (cfg.bnb_4bit_quant_type, cfg.bnb_4bit_use_double_quant) == ("nf4", False)  # TRL's ModelConfig
        nested = parse([*trl, "--use_peft", "--load_in_4bit", "--use_bnb_nested_quant", "--bnb_4bit_quant_type=fp4",
                        "--bnb_4bit_quant_storage", "bfloat16"])
        assert (nested.bnb_4bit_quant_type, nested.bnb_4bit_use_double_quant) == ("fp4", True)
        assert (cfg.bnb_4bit_quant_storage, nested.bnb_4bit_quant_storage) == ("uint8", "bfloat16")
        with pytest.raises(ConfigError, match="trains nothing without them: set use_lora=true"):
            parse([*trl, "--load_in_4bit"])
    assert not parse_sft([*trl, "--use_peft", "--load_in_4bit", "false"]).load_in_4bit
    for parse in (parse_sft, parse_dpo):  # OpenRLHF's: --load_in_4bit --lora_rank N, its scripts' --zero_stage kept
        cfg = parse([*openrlhf, "--load_in_4bit", "--lora_rank", "16", "--zero_stage", "2"])
        assert (cfg.use_lora, cfg.lora_rank, cfg.load_in_4bit, cfg.lora_export, cfg.strategy) == (
            True, 16, True, "adapter", "ddp")
        assert (cfg.bnb_4bit_quant_type, cfg.bnb_4bit_use_double_quant) == ("nf4", True)  # OpenRLHF's
    assert "--zero_stage with --load_in_4bit: the 4-bit base trains under strategy=ddp" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="lora_export=merged folds the adapters"):
        parse_sft([*openrlhf, "--load_in_4bit", "--lora_rank", "16", "--lora_export", "merged"])


def test_a_4bit_kd_student_learns_from_its_unquantized_teacher(tiny_model_dir, tmp_path, capsys):
    from alignrl.preference.kd_cli import kd_main

    rc = kd_main([f"model_path={tiny_model_dir}", f"teacher_model_path={tiny_model_dir}", "kd_coef=1",
                  f"train_files=[{_jsonl(tmp_path / 'rows.jsonl', SFT_ROWS)}]", "batch_size=4", "max_steps=2",
                  *OFFLINE_QLORA, "--output_dir", str(tmp_path / "kd"), "--logging_dir", str(tmp_path / "logs")])
    assert rc == 0 and "base quantized to 4-bit NF4" in capsys.readouterr().out
    rows = [r for r in _metrics(tmp_path / "logs") if "train/distil_loss" in r]
    assert len(rows) == 2 and all(math.isfinite(r["train/distil_loss"]) for r in rows)  # the teacher's term ran
    trained = load_file(tmp_path / "kd" / "adapter_model.safetensors")
    assert trained and all("lora_" in k for k in trained)
