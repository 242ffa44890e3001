"""The lines of OpenRLHF's current offline scripts (train_sft.sh, train_rm.sh, train_dpo_llama.sh, train_kto_llama.sh,
test_sft_fsdp2.sh) and of TRL's sft.py, dpo.py and kto.py usage blocks on `alignrl train sft|rm|dpo|kto`, parsed
(no training): each translated value, each note, and each one-line refusal."""

import pytest
from pathlib import Path

from alignrl.config import ConfigError
from alignrl.preference.cli import parse_dpo, parse_rm
from alignrl.preference.kto_cli import parse_kto
from alignrl.preference.sft_cli import parse_sft

SFT_SH = """
--max_len 2048 --dataset Open-Orca/OpenOrca --input_key question --output_key response --train_batch_size 256
--micro_train_batch_size 2 --max_samples 500000 --pretrain meta-llama/Meta-Llama-3-8B --save_path
./checkpoint/llama3-8b-sft --save_steps -1 --logging_steps 1 --eval_steps -1 --zero_stage 2 --max_epochs 1
--param_dtype bf16 --attn_implementation flash_attention_2 --learning_rate 5e-6 --load_checkpoint
--packing_samples --gradient_checkpointing
""".split()
PAIRS = """
--save_steps -1 --logging_steps 1 --eval_steps -1 --train_batch_size 256 --micro_train_batch_size 1 --pretrain
OpenRLHF/Llama-3-8b-sft-mixture --param_dtype bf16 --max_epochs 1 --max_len 8192
""".split()
PAIR_DATA = """
--dataset OpenRLHF/preference_dataset_mixture2_and_safe_pku --apply_chat_template --chosen_key chosen
--rejected_key rejected --attn_implementation flash_attention_2 --load_checkpoint --packing_samples
--gradient_checkpointing
""".split()
RM_SH = ["--save_path", "./checkpoint/llama3-8b-rm", *PAIRS, "--zero_stage", "3", "--learning_rate", "9e-6",
         *PAIR_DATA]
DPO_SH = ["--save_path", "./checkpoint/llama3-8b-dpo", *PAIRS, "--learning_rate", "5e-7", "--beta", "0.1", *PAIR_DATA]
KTO_SH = """
--save_path ./checkpoint/llama3-8b-kto --save_steps -1 --logging_steps 1 --eval_steps -1 --train_batch_size 64
--micro_train_batch_size 1 --pretrain OpenRLHF/Llama-3-8b-sft-mixture --param_dtype bf16 --max_epochs 1
--max_len 8192 --learning_rate 5e-7 --dataset Dylan2048/ultrafeedback-unpaired-preferences --input_key
instruction --output_key response --label_key score --attn_implementation flash_attention_2 --beta 0.1
--max_samples 1024 --gradient_checkpointing
""".split()
FSDP2_SH = """
--backend fsdp2 --max_len 512 --dataset Open-Orca/OpenOrca --input_key question --output_key response
--train_batch_size 128 --micro_train_batch_size 2 --max_samples 1000 --pretrain meta-llama/Meta-Llama-3-8B
--save_path ./checkpoint/llama3-8b-sft-fsdp2 --save_steps -1 --logging_steps 1 --eval_steps -1 --max_epochs 1
--param_dtype bf16 --attn_implementation flash_attention_2 --learning_rate 5e-6 --gradient_checkpointing
""".split()
TRL_SFT = """
--model_name_or_path Qwen/Qwen2-0.5B --dataset_name trl-lib/Capybara --learning_rate 2.0e-5 --num_train_epochs 1
--packing --per_device_train_batch_size 2 --gradient_accumulation_steps 8 --gradient_checkpointing --eos_token
<|im_end|> --eval_strategy steps --eval_steps 100 --output_dir Qwen2-0.5B-SFT --push_to_hub
""".split()
TRL_DPO = """
--dataset_name trl-lib/ultrafeedback_binarized --dataset_streaming --model_name_or_path Qwen/Qwen2-0.5B-Instruct
--learning_rate 5.0e-7 --num_train_epochs 1 --per_device_train_batch_size 2 --gradient_accumulation_steps 8
--gradient_checkpointing --logging_steps 25 --eval_strategy steps --eval_steps 50 --output_dir Qwen2-0.5B-DPO
--no_remove_unused_columns
""".split()
TRL_KTO = """
--model_name_or_path=trl-lib/qwen1.5-1.8b-sft --per_device_train_batch_size 16 --num_train_epochs 1
--learning_rate 1e-6 --lr_scheduler_type=cosine --gradient_accumulation_steps 1 --logging_steps 10 --eval_steps
500 --output_dir=kto-aligned-model --warmup_ratio 0.1 --report_to wandb --bf16 --logging_first_step
""".split()


def _without(line: list[str], *flags: str) -> list[str]:
    """The line without `flags` (a flag's value too: a word after it that is not a flag)."""
    out, skip = [], False
    for word in line:
        if word in flags:
            skip = True
            continue
        if skip and not word.startswith("--"):
            continue
        skip = False
        out.append(word)
    return out


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the lines' ./checkpoint/... folders


def test_openrlhf_current_sft_rm_dpo_lines_parse_to_our_keys(capsys):
    """--param_dtype bf16 is bf16=true, --attn_implementation changes nothing (SDPA), --load_checkpoint
    resumes from the newest checkpoint when the run starts (resume_from=auto), --zero_stage runs DeepSpeed."""
    sft = parse_sft(SFT_SH)
    assert (sft.bf16, sft.strategy, sft.zero_stage, sft.resume_from) == ("true", "deepspeed", 2, "auto")
    assert (sft.model_path, sft.train_files, sft.prompt_key, sft.response_key) == (
        "meta-llama/Meta-Llama-3-8B", ["Open-Orca/OpenOrca"], "question", "response")
    assert (sft.max_length, sft.batch_size, sft.train_batch_size, sft.max_train_pairs) == (2048, 2, 256, 500000)
    assert (sft.packing, sft.packing_strategy, sft.learning_rate, sft.epochs) == (True, "micro_batch", 5e-6, 1)
    assert (sft.save_steps, sft.eval_steps, sft.log_every, sft.gradient_checkpointing) == (0, 0, 1, True)
    err = capsys.readouterr().err
    assert "--attn_implementation changes nothing here and is ignored (attention runs through PyTorch's SDPA" in err
    assert "bf16=" not in err  # the line gives the dtype itself
    rm = parse_rm(RM_SH)
    assert (rm.bf16, rm.strategy, rm.zero_stage, rm.learning_rate, rm.max_length) == (
        "true", "deepspeed", 3, 9e-6, 8192)
    assert (rm.helpful_train_file, rm.chosen_key, rm.apply_chat_template, rm.output_dir) == (
        "OpenRLHF/preference_dataset_mixture2_and_safe_pku", "chosen", True, "./checkpoint/llama3-8b-rm")
    dpo = parse_dpo(DPO_SH)
    assert (dpo.bf16, dpo.strategy, dpo.beta, dpo.learning_rate, dpo.loss_type) == ("true", "ddp", 0.1, 5e-7, "sigmoid")
    assert (dpo.batch_size, dpo.train_batch_size, dpo.resume_from) == (1, 256, "auto")


def test_openrlhf_fsdp2_and_kto_lines_and_the_current_default_dtype(capsys):
    """--backend fsdp2 is strategy=fsdp2; a current line silent on the dtype takes OpenRLHF's current bf16, an older
    one (no current flag) its float32; --param_dtype fp16 and an unknown backend are one line each."""
    fsdp2 = parse_sft(FSDP2_SH)
    assert (fsdp2.strategy, fsdp2.bf16, fsdp2.max_train_pairs, fsdp2.train_batch_size) == ("fsdp2", "true", 1000, 128)
    capsys.readouterr()
    assert parse_sft(_without(FSDP2_SH, "--param_dtype", "--attn_implementation")).bf16 == "true"
    assert "bf16=true" in capsys.readouterr().err  # said among OpenRLHF's defaults
    assert parse_sft(_without(FSDP2_SH, "--param_dtype", "--attn_implementation", "--backend")).bf16 == "false"
    with pytest.raises(ConfigError, match=r"^--param_dtype fp16: the offline trainers compute in bfloat16 or float32"):
        parse_dpo(["--pretrain", "demo", "--param_dtype", "fp16"])
    with pytest.raises(ConfigError, match=r"^--backend megatron: the training engines here are ddp, fsdp2"):
        parse_dpo(["--pretrain", "demo", "--backend", "megatron"])
    with pytest.raises(ConfigError, match="loss_type=kto with batch_size=1"):  # every flag of train_kto_llama.sh read
        parse_kto(KTO_SH)
    kto = parse_kto(KTO_SH[:KTO_SH.index("--micro_train_batch_size") + 1] + ["2"] +
                    KTO_SH[KTO_SH.index("--micro_train_batch_size") + 2:])
    assert (kto.bf16, kto.prompt_key, kto.completion_key, kto.label_key, kto.beta) == (
        "true", "instruction", "response", "score", 0.1)


def test_load_checkpoint_goes_on_from_the_latest_complete_checkpoint(tmp_path):
    """As OpenRLHF's: the run's checkpoints when there are some (the highest complete step_N, found when the run
    starts), the base model on a first run; a resume_from of the line's own wins; --ckpt_path names the folder and
    --max_ckpt_num how many are kept."""
    from alignrl.preference.checkpoint_plan import plan_for, resume_folder

    cfg = parse_dpo(DPO_SH)
    assert cfg.resume_from == "auto" and cfg.save_total_limit == 3  # OpenRLHF's --max_ckpt_num default
    out = Path(cfg.output_dir)
    root = tmp_path / out.parent / f"{out.name}.checkpoints"
    for step in (2, 10):
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / "weights.safetensors").write_bytes(b"")
        (root / f"step_{step}" / "state.json").write_text("{}")
    (root / "step_30").mkdir()  # incomplete: no weights
    (root / ".step_40.tmp").mkdir()
    said = []
    log = type("Log", (), {"print": staticmethod(said.append)})
    assert resume_folder(cfg, plan_for(cfg, tmp_path / out, 50, 10), log) == str(root / "step_10")
    assert said == [f"resume_from=auto: going on from {root / 'step_10'}, the latest checkpoint in {root}"]
    own = str(root / "step_2")
    assert parse_dpo(DPO_SH + [f"resume_from={own}"]).resume_from == own
    assert parse_dpo(["--pretrain", "demo", "--load_checkpoint", "false"]).resume_from is None
    given = parse_dpo(DPO_SH + ["--ckpt_path", str(tmp_path / "ck"), "--max_ckpt_num", "1"])
    assert (given.checkpoint_dir, given.save_total_limit) == (str(tmp_path / "ck"), 1)
    assert plan_for(given, out, 50, 10).root == tmp_path / "ck"


def test_trl_sft_dpo_kto_lines(capsys):
    """--eval_strategy on sft as on dpo (TRL's default no: held-out rows measured before and after only), --report_to
    wandb, --no_remove_unused_columns and --logging_first_step
    accepted; --eos_token sft's key, refused elsewhere; --push_to_hub and --dataset_streaming refused in one line; a
    TRL line without a dataset is told TRL's flag."""
    with pytest.raises(ConfigError, match=r"^--push_to_hub is not supported here: upload .* `huggingface-cli upload`"):
        parse_sft(TRL_SFT)
    sft = parse_sft(_without(TRL_SFT, "--push_to_hub") + ["--push_to_hub", "false"])
    assert (sft.eval_steps, sft.packing, sft.packing_strategy, sft.gradient_accumulation_steps) == (100, True, "bfd", 8)
    assert sft.eval_strategy == "steps" and parse_sft(_without(TRL_SFT, "--push_to_hub", "--eval_strategy")
                                                      ).eval_strategy == "no"
    assert sft.eos_token == "<|im_end|>"  # sft's key; the other commands refuse the flag
    with pytest.raises(ConfigError, match=r'^--eos_token is not supported here: .*"eos_token" in the model folder'):
        parse_dpo(_without(TRL_DPO, "--dataset_streaming") + ["--eos_token", "<|im_end|>"])
    with pytest.raises(ConfigError, match=r"eval_strategy.*sometimes.*(no|steps|epoch)"):
        parse_sft(_without(TRL_SFT, "--eos_token", "--push_to_hub", "--eval_strategy") +
                  ["--eval_strategy", "sometimes"])
    with pytest.raises(ConfigError, match=r"^--dataset_streaming is not supported here: the dataset is read whole"):
        parse_dpo(TRL_DPO)
    capsys.readouterr()
    dpo = parse_dpo(_without(TRL_DPO, "--dataset_streaming") + ["--report_to", "wandb"])
    assert (dpo.report_to, dpo.eval_steps, dpo.log_every, dpo.loss_type) == (["wandb"], 50, 25, "sigmoid")
    assert "--no_remove_unused_columns changes nothing here" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"^train_files is empty: give the training rows, --dataset_name NAME_OR_F"):
        parse_kto(TRL_KTO)
    assert "--logging_first_step changes nothing here" in capsys.readouterr().err
    kto = parse_kto(TRL_KTO + ["--dataset_name", "feedback.jsonl"])
    assert (kto.report_to, kto.bf16, kto.lr_scheduler, kto.batch_size) == (["wandb"], "true", "cosine", 16)
    with pytest.raises(ConfigError, match=r"give the training rows, --dataset FILE$"):
        parse_kto(["--pretrain", "demo"])
    with pytest.raises(ConfigError, match=r"give the training rows, --dataset_name NAME_OR_FILE$"):
        parse_sft(["--model_name_or_path", "demo"])
    assert parse_rm(["--report_to", "none"]).report_to == []
    assert parse_rm(["--report_to", "all"]).report_to == ["jsonl", "tensorboard", "wandb"]


def test_unrecognized_arguments_name_only_the_unknown_words():
    """The overrides the flags became are the parser's own words: the line names only the flag it does not know."""
    with pytest.raises(ConfigError) as e:
        parse_kto(["--pretrain", "demo", "--bogus", "x", "--beta", "0.2", "--max_len", "64", "--dataset", "a.jsonl"])
    assert str(e.value) == "alignrl train kto: unrecognized arguments: --bogus x (see --help)"
