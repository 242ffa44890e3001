"""OpenRLHF's `train_dpo` / `train_rm` and TRL's DPO and reward-modeling script flags on `alignrl train dpo|rm`:
their spellings parse to our keys, their scripts train, their global batch becomes gradient accumulation, their
column names load, and what is left out is refused in one line."""

import dataclasses
import json
import os
from pathlib import Path

import pytest

from alignrl.config import ConfigError
from alignrl.data.loaders import DataError
from alignrl.data.preference import PairColumns, load_pairs
from alignrl.preference.cli import dpo_main, parse_dpo, parse_rm, rm_main, with_global_batch
from alignrl.preference.configs import DPOConfig, RMConfig
from alignrl.preference.flag_names import COMMON_NAMES, DPO_FLAGS, RM_FLAGS
from alignrl.preference.kto_cli import KTO_FLAGS, KTOConfig, parse_kto
from alignrl.preference.sft_cli import SFTConfig, parse_sft, sft_flags
from alignrl.preference.their_defaults import OPENRLHF_NAMES, SHARED_NAMES, TRL_NAMES

REPO = Path(__file__).resolve().parents[1]


def _conversation(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _openrlhf_pairs(tmp_path: Path) -> str:
    """OpenRLHF's preference_dataset_mixture layout: chosen and rejected are whole conversations, no prompt column."""
    rows = [{"chosen": _conversation(f"What is {i} + {i}?", f"It is {2 * i}."),
             "rejected": _conversation(f"What is {i} + {i}?", "I do not know.")} for i in range(4)]
    return _write(tmp_path / "pairs.jsonl", rows)


def _renamed_pairs(tmp_path: Path) -> str:
    rows = [{"question": f"Name colour {i}.", "good": "Blue.", "bad": "Seven.", "prompt": "not this one"}
            for i in range(4)]
    return _write(tmp_path / "renamed.jsonl", rows)


def _dpo_script(model: Path, data: str, out: Path) -> list[str]:
    """The DPO example of OpenRLHF's README, pointed at local files."""
    return ["--save_path", str(out), "--save_steps", "-1", "--logging_steps", "1", "--eval_steps", "-1",
            "--micro_train_batch_size", "1", "--pretrain", str(model), "--bf16", "--max_epochs", "1", "--max_len",
            "8192", "--zero_stage", "3", "--learning_rate", "5e-7", "--beta", "0.1", "--dataset", data,
            "--apply_chat_template", "--chosen_key", "chosen", "--rejected_key", "rejected", "--flash_attn",
            "--gradient_checkpointing"]


def test_openrlhf_dpo_script_parses_and_trains_a_step(tiny_model_dir, tmp_path, capsys):
    data, out = _openrlhf_pairs(tmp_path), tmp_path / "dpo"
    cfg = parse_dpo(_dpo_script(tiny_model_dir, data, out))
    assert (cfg.model_path, cfg.output_dir, cfg.train_files) == (str(tiny_model_dir), str(out), [data])
    assert (cfg.batch_size, cfg.max_length, cfg.epochs, cfg.learning_rate, cfg.beta) == (1, 8192, 1, 5e-7, 0.1)
    assert (cfg.save_steps, cfg.eval_steps, cfg.log_every, cfg.zero_stage, cfg.bf16) == (0, 0, 1, 3, "true")
    assert cfg.eval_strategy == "epoch"  # the script's --eval_steps -1: OpenRLHF's once per epoch
    assert cfg.gradient_checkpointing and cfg.loss_type == "sigmoid"  # theirs, not this command's safe_mm_dpo
    assert cfg.eval_files == [data]  # no --eval_dataset: their own pairs are held out, not the shipped demo ones
    # what the script leaves unsaid is OpenRLHF's train_dpo default, said in one line; what it gives stays
    assert (cfg.warmup_ratio, cfg.adam_betas, cfg.train_batch_size) == (0.03, [0.9, 0.95], 128)
    err = capsys.readouterr().err
    assert ("alignrl: note: OpenRLHF's train_dpo defaults where the line is silent: warmup_ratio=0.03, adam_betas="
            "[0.9, 0.95], train_batch_size=128, save_total_limit=3, loss_type=sigmoid; not taken: prompt_key=None (a row's prompt column "
            "is read: prompt_key=prompt kept)\n") in err and "--flash_attn changes nothing" in err
    assert cfg.apply_chat_template and cfg.input_template is None  # templated: their template default is not taken
    # four pairs fill no global batch of OpenRLHF's 128
    assert dpo_main([*_dpo_script(tiny_model_dir, data, out), "--logging_dir", str(tmp_path / "logs"),
                     "max_steps=1", "train_batch_size=1"]) == 0
    results = json.loads((out / "eval_results.json").read_text())
    assert results["steps"] == 1 and (out / "config.json").is_file()


def test_openrlhf_rm_script_with_renamed_columns_trains_a_step(tiny_model_dir, tmp_path):
    """Without --apply_chat_template, on OpenRLHF's text: the prompt formatted into --input_template."""
    data, out = _renamed_pairs(tmp_path), tmp_path / "rm"
    argv = ["--pretrain", str(tiny_model_dir), "--value_head_prefix", "score", "--dataset", data, "--eval_dataset",
            data, "--prompt_key", "question", "--chosen_key", "good", "--rejected_key", "bad", "--max_len", "64",
            "--micro_train_batch_size", "2", "--train_batch_size", "4", "--max_samples", "4", "--save_path", str(out),
            "--logging_dir", str(tmp_path / "logs"), "--l2", "0.01", "--lr_scheduler", "cosine_with_min_lr",
            "--loss", "sigmoid", "--input_template", "Q: {}\nA: "]
    cfg = parse_rm(argv)
    assert (cfg.apply_chat_template, cfg.input_template) == (False, "Q: {}\nA: ")
    assert (cfg.task, cfg.model_type, cfg.helpful_train_file, cfg.helpful_eval_file) == ("helpful", "auto", data, data)
    assert (cfg.prompt_key, cfg.chosen_key, cfg.rejected_key) == ("question", "good", "bad")
    assert (cfg.batch_size, cfg.train_batch_size, cfg.max_train_pairs, cfg.weight_decay) == (2, 4, 4, 0.01)
    assert cfg.lr_scheduler == "cosine"
    assert rm_main(argv) == 0
    results = json.loads((out / "eval_results.json").read_text())
    assert (results["model_type"], results["steps"], results["effective_batch"]) == ("reward", 1, 4)


def test_train_batch_size_becomes_accumulation_once_the_ranks_are_known(tmp_path, capsys):
    line = ["--micro_train_batch_size", "2", "--train_batch_size", "8"]
    assert with_global_batch(parse_dpo(line), 1).gradient_accumulation_steps == 4
    assert with_global_batch(parse_dpo(line), 2).gradient_accumulation_steps == 2
    assert with_global_batch(parse_rm(line), 2).gradient_accumulation_steps == 2
    sft_rows = _write(tmp_path / "sft.jsonl", [{"prompt": "q", "completion": "a"}])
    assert with_global_batch(parse_sft(["--dataset", sft_rows, *line]), 4).gradient_accumulation_steps == 1
    assert with_global_batch(parse_dpo(["batch_size=2"]), 2).gradient_accumulation_steps == 1  # none given
    with pytest.raises(ConfigError, match=r"train_batch_size=8 is not a whole number of batch_size × ranks = "
                                          r"2 × 3 = 6"):
        with_global_batch(parse_dpo(line), 3)
    with pytest.raises(ConfigError, match="means gradient_accumulation_steps=2 .* not 3; give one of the two"):
        with_global_batch(parse_dpo([*line, "gradient_accumulation_steps=3"]), 2)
    capsys.readouterr()
    # refused before any process starts: --nproc's ranks count
    assert rm_main([*line, "--train_batch_size", "6", "--nproc", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the note of OpenRLHF's defaults taken
    assert err == ("alignrl: error: train_batch_size=6 is not a whole number of batch_size × ranks = 2 × 2 = 4; "
                   "give a multiple of 4")


def test_renamed_pair_columns_load_and_other_layouts_keep_their_names(tmp_path):
    data = _renamed_pairs(tmp_path)
    pair = load_pairs(data, columns=PairColumns("question", "good", "bad"))[0]
    assert (pair.prompt, pair.chosen, pair.rejected) == ([{"role": "user", "content": "Name colour 0."}], "Blue.",
                                                         "Seven.")
    swapped = load_pairs(data, columns=PairColumns("question", "bad", "good"))[0]
    assert (swapped.chosen, swapped.rejected) == ("Seven.", "Blue.")
    with pytest.raises(DataError, match=r"renamed.jsonl:1: row is missing better \(chosen_key\), worse "
                                        r"\(rejected_key\); its columns: question, good, bad, prompt"):
        load_pairs(data, columns=PairColumns("question", "better", "worse"))
    pku = _write(tmp_path / "pku.jsonl", [{"prompt": "p", "response_0": "a", "response_1": "b",
                                           "better_response_id": 1, "safer_response_id": 0}])
    assert load_pairs(pku, columns=PairColumns("question", "good", "bad"))[0].chosen == "b"
    implicit = load_pairs(_openrlhf_pairs(tmp_path), columns=PairColumns("no_such_prompt"))[0]
    assert implicit.prompt == [{"role": "user", "content": "What is 0 + 0?"}] and implicit.chosen == "It is 0."


def test_trl_spellings_parse(tmp_path, monkeypatch):
    data = _openrlhf_pairs(tmp_path)
    cfg = parse_dpo(["--model_name_or_path", "demo", "--dataset_name", data, "--per_device_train_batch_size", "2",
                     "--gradient_accumulation_steps", "4", "--num_train_epochs", "2", "--learning_rate", "5.0e-6",
                     "--gradient_checkpointing", "True", "--logging_steps", "25", "--eval_strategy", "steps",
                     "--eval_steps", "50", "--output_dir", str(tmp_path / "o"), "--use_peft", "--lora_r", "32",
                     "--lora_alpha", "16", "--rpo_alpha", "0.5", "--max_grad_norm", "0.5", "--lr_scheduler_type",
                     "constant", "--per_device_eval_batch_size", "4", "--bf16", "False"])
    assert (cfg.train_files, cfg.batch_size, cfg.gradient_accumulation_steps, cfg.epochs) == ([data], 2, 4, 2)
    assert (cfg.log_every, cfg.eval_steps, cfg.use_lora, cfg.lora_rank, cfg.lora_alpha) == (25, 50, True, 32, 16)
    assert (cfg.nll_loss_coef, cfg.grad_clip, cfg.lr_scheduler, cfg.eval_batch_size) == (0.5, 0.5, "constant", 4)
    assert (cfg.loss_type, cfg.bf16, cfg.gradient_checkpointing) == ("sigmoid", "false", True)
    assert parse_dpo(["--pretrain", "demo", "--ipo"]).loss_type == "ipo"  # OpenRLHF's switch
    assert parse_dpo(["--pretrain", "demo", "--loss_type", "hinge"]).loss_type == "hinge"
    assert parse_dpo(["--ref_pretrain", "demo"]).ref_model_path == "demo"
    for name in ("WANDB_API_KEY", "WANDB_PROJECT"):  # set then removed: whatever the parse sets is undone after
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    wandb = parse_dpo(["--use_wandb", "KEY", "--wandb_project", "p", "--use_tensorboard", "logs/tb"])
    assert wandb.report_to == ["jsonl", "tensorboard", "wandb"]  # OpenRLHF's wandb logger, its key the API key
    assert (os.environ["WANDB_API_KEY"], os.environ["WANDB_PROJECT"]) == ("KEY", "p")
    assert "wandb" not in parse_dpo(["--use_wandb", "false"]).report_to
    assert parse_dpo(["beta=0.2"]).loss_type == "safe_mm_dpo"  # our own spelling keeps our default
    yaml = tmp_path / "c.yaml"
    yaml.write_text("loss_type: ipo\n")
    assert parse_dpo(["--config", str(yaml), "--pretrain", "demo"]).loss_type == "ipo"  # a YAML's loss stays
    assert parse_dpo(["--max_len", "64", "max_length=32"]).max_length == 64  # a flag wins over an override
    rm = parse_rm(["--model_name_or_path", "demo", "--dataset_name", data, "--lora_rank", "0"])
    assert (rm.helpful_train_file, rm.helpful_eval_file, rm.use_lora) == (data, data, False)


@pytest.mark.parametrize("parse, argv, expect", [
    (parse_dpo, ["--pretrain", "demo", "--bogus_flag", "1"], "unrecognized arguments: --bogus_flag"),
    (parse_dpo, ["--input_template", "User:"], "input_template='User:' must hold one {} where the prompt goes"),
    (parse_rm, ["input_template=Q: {} A: {}"], "input_template='Q: {} A: {}' must hold one {}"),
    (parse_sft, ["--dataset", "x.jsonl", "--input_template", "{x}"], "input_template='{x}' must hold one {}"),
    (parse_kto, ["--dataset", "x.jsonl", "--input_template", "{"], "input_template='{' must hold one {}"),
    (parse_dpo, ["--max_len"], "--max_len needs a value"),
    (parse_rm, ["--value_head_prefix", "head"], "--value_head_prefix head: alignrl saves the head as score"),
    (parse_rm, ["--loss", "logexpsigmoid"], "--loss logexpsigmoid: the reward model trains with the Bradley-Terry"),
    (parse_rm, ["--dataset", "x.jsonl", "--task", "harmless"], "--dataset names a reward model's pairs"),
    (parse_rm, ["adam_betas=[0.9]"], "adam_betas=[0.9] must be two numbers in [0, 1)"),
    (parse_dpo, ["loss_type=orpo", "--rpo_alpha", "1.0"], "loss_type=orpo already trains the chosen responses' NLL"),
])
def test_wrong_flags_are_one_line(parse, argv, expect):
    with pytest.raises(ConfigError) as e:
        parse(argv)
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_openrlhfs_zero_stage_runs_deepspeed_and_its_list_flags_take_several_words(capsys):
    """OpenRLHF always trains under DeepSpeed: --zero_stage N asks for it unless the line picks a strategy; its
    nargs flags (--adam_betas 0.9 0.95, --target_modules q_proj v_proj) are lists; packing trains padded."""
    cfg = parse_rm(["--pretrain", "demo", "--zero_stage", "3", "--adam_betas", "0.9", "0.95", "--target_modules",
                    "q_proj", "v_proj", "--packing_samples", "epochs=2"])
    assert (cfg.strategy, cfg.zero_stage, cfg.adam_betas, cfg.lora_target_modules, cfg.epochs) == (
        "deepspeed", 3, [0.9, 0.95], ["q_proj", "v_proj"], 2)
    err = capsys.readouterr().err
    assert "--zero_stage runs DeepSpeed" in err and "--packing_samples changes nothing here" in err
    assert parse_rm(["--zero_stage=2", "strategy=fsdp2"]).strategy == "fsdp2"  # a strategy of the line's own wins


def test_a_wrong_flag_exits_2_with_one_line(capsys):
    assert dpo_main(["--pretrain", "demo", "--ipo", "--beta", "0.1", "--max_norm"]) == 2
    assert capsys.readouterr().err.strip() == "alignrl: error: --max_norm needs a value (--max_norm VALUE)"


def _silent_note(err: str) -> list[str]:
    return [line for line in err.splitlines() if "defaults where the line is silent" in line or "share" in line]


def test_a_line_in_openrlhfs_spelling_takes_its_defaults_and_its_own_flags_win(tmp_path, capsys):
    """What an OpenRLHF line leaves unsaid trains as its script's default (train_dpo: warm-up 0.03, betas 0.9 0.95,
    lr 1e-5, max_len 512, global batch 128, fp32 without --bf16, logging every step), said in one line; a flag, a
    key=value word or the --config file of the line wins; LoRA's defaults come with LoRA."""
    capsys.readouterr()
    cfg = parse_dpo(["--pretrain", "demo", "--dataset", "pairs.jsonl"])
    assert (cfg.warmup_ratio, cfg.adam_betas, cfg.learning_rate, cfg.max_length) == (0.03, [0.9, 0.95], 1e-5, 512)
    assert (cfg.train_batch_size, cfg.bf16, cfg.log_every, cfg.loss_type) == (128, "false", 1, "sigmoid")
    assert (cfg.lr_scheduler, cfg.min_lr_ratio, cfg.lora_alpha) == ("cosine", 0.1, 32)  # the same / LoRA is off
    (note,) = _silent_note(capsys.readouterr().err)
    assert note == ("alignrl: note: OpenRLHF's train_dpo defaults where the line is silent: warmup_ratio=0.03, "
                    "adam_betas=[0.9, 0.95], train_batch_size=128, log_every=1, bf16=false, eval_strategy=epoch, "
                    "save_total_limit=3, "
                    "learning_rate=1e-05, "
                    "max_length=512, loss_type=sigmoid, apply_chat_template=false, input_template=\"{}\"; not taken: "
                    "prompt_key=None (a row's prompt column is read: prompt_key=prompt kept)")
    yaml = tmp_path / "c.yaml"
    yaml.write_text("max_length: 100\nlog_every: 7\n")
    given = parse_dpo(["--pretrain", "demo", "--lr_warmup_ratio", "0.2", "--adam_betas", "0.8", "0.9", "--bf16",
                       "learning_rate=3e-5", "--config", str(yaml), "gradient_accumulation_steps=2", "--lora_rank",
                       "8"])
    assert (given.warmup_ratio, given.adam_betas, given.learning_rate, given.bf16) == (0.2, [0.8, 0.9], 3e-5, "true")
    assert (given.max_length, given.log_every, given.train_batch_size) == (100, 7, 0)  # the file's; its own batch
    assert (given.use_lora, given.lora_alpha, given.lora_dropout) == (True, 16, 0.0)  # OpenRLHF's LoRA defaults
    (note,) = _silent_note(capsys.readouterr().err)
    assert "warmup_ratio" not in note and "max_length" not in note and "lora_alpha=16" in note
    kto = parse_kto(["--pretrain", "demo", "--dataset", "rows.jsonl"])
    assert (kto.beta, kto.learning_rate, kto.max_length, kto.prompt_key) == (0.01, 1e-5, 2048, "prompt")
    assert "not taken: input_key=input" in _silent_note(capsys.readouterr().err)[0]
    assert (parse_sft(["--dataset", "rows.jsonl"]).epochs, parse_rm(["--pretrain", "demo"]).batch_size) == (2, 1)


def test_a_trl_line_takes_trls_defaults_and_a_mixed_line_only_the_shared_ones(capsys):
    capsys.readouterr()
    rm = parse_rm(["--model_name_or_path", "demo", "--dataset_name", "pairs.jsonl"])
    assert (rm.learning_rate, rm.epochs, rm.warmup_ratio, rm.adam_betas, rm.max_length) == (
        1e-4, 3, 0.0, [0.9, 0.999], 1024)
    assert (rm.log_every, rm.save_steps, rm.gradient_checkpointing, rm.eval_batch_size, rm.bf16) == (
        10, 500, True, 8, "auto")
    (note,) = _silent_note(capsys.readouterr().err)
    assert note.startswith("alignrl: note: TRL's RewardConfig defaults where the line is silent: warmup_ratio=0.0, ")
    assert "lr_scheduler=linear, min_lr_ratio=0.0" in note and "not taken" not in note  # TRL's linear decay to 0
    dpo = parse_dpo(["--model_name_or_path", "demo", "--lr_scheduler_type", "constant", "--num_train_epochs", "1"])
    assert (dpo.learning_rate, dpo.epochs, dpo.lr_scheduler, dpo.loss_type) == (1e-6, 1, "constant", "sigmoid")
    assert "not taken" not in _silent_note(capsys.readouterr().err)[0]
    assert parse_sft(["--model_name_or_path", "demo", "--dataset_name", "rows.jsonl"]).assistant_only_loss is False
    capsys.readouterr()
    mixed = parse_dpo(["--pretrain", "demo", "--num_train_epochs", "2"])
    assert (mixed.loss_type, mixed.warmup_ratio, mixed.learning_rate, mixed.epochs) == ("sigmoid", 0.1, 5e-5, 2)
    assert _silent_note(capsys.readouterr().err) == [
        "alignrl: note: --pretrain, --num_train_epochs: OpenRLHF's and TRL's names mixed, so only the defaults the "
        "two share are taken: loss_type=sigmoid, apply_chat_template=false"]


def test_a_line_in_our_own_keys_is_unchanged(capsys):
    """Nothing of theirs reaches a line of our keys (a key's own name as a flag is ours): the config is the command's
    defaults with the line's values, exactly."""
    capsys.readouterr()
    assert parse_dpo(["beta=0.2", "--learning_rate", "1e-5", "--epochs", "2"]) == DPOConfig(
        beta=0.2, learning_rate=1e-5, epochs=2)
    assert parse_rm(["--max_length", "64", "warmup_ratio=0.2"]) == RMConfig(max_length=64, warmup_ratio=0.2)
    assert parse_sft(["train_files=[a.jsonl]", "--log_every", "3"]) == SFTConfig(train_files=["a.jsonl"], log_every=3)
    assert parse_kto(["train_files=[a.jsonl]", "--adam_betas", "0.9", "0.95"]) == dataclasses.replace(
        KTOConfig(), train_files=["a.jsonl"], adam_betas=[0.9, 0.95])
    # a name both OpenRLHF and TRL have decides nothing: the loss and the held-out pairs stay this command's
    assert parse_dpo(["train_files=[x/y]", "--logging_steps", "3"]) == DPOConfig(train_files=["x/y"], log_every=3)
    assert _silent_note(capsys.readouterr().err) == []


def test_every_flag_name_of_theirs_is_one_spellings():
    """Whose spelling a line is in is read from its names: each renamed flag and switch of the offline commands is
    OpenRLHF's, TRL's or both's, exactly one of these, and no listed name is stale."""
    tables = [RM_FLAGS, DPO_FLAGS, KTO_FLAGS, sft_flags([]), sft_flags(["--multiturn"])]
    theirs = {k for t in tables for k, v in t.all_names().items() if k != v} | {k for t in tables for k in t.switches}
    assert theirs == OPENRLHF_NAMES | TRL_NAMES | SHARED_NAMES
    assert not (OPENRLHF_NAMES & TRL_NAMES or OPENRLHF_NAMES & SHARED_NAMES or TRL_NAMES & SHARED_NAMES)
    assert {"pretrain", "max_len"} <= OPENRLHF_NAMES and {"model_name_or_path", "num_train_epochs"} <= TRL_NAMES
    assert set(COMMON_NAMES) <= theirs | {k for k, v in COMMON_NAMES.items() if k == v}


def test_split_flags_name_the_split_of_a_dataset_and_change_nothing_for_a_file(tmp_path, capsys):
    """TRL's --dataset_train_split/--dataset_test_split and OpenRLHF's --dataset_split/--train_split/--eval_split
    pick a dataset folder's or Hub dataset's split (alignrl.data.sources reads `name[split]`); a held-out split
    without a held-out dataset reads the training dataset's; a split each setting reads unasked adds nothing."""
    cfg = parse_dpo(["--model_name_or_path", "demo", "--dataset_name", "HuggingFaceH4/ultrafeedback_binarized",
                     "--dataset_train_split", "train_prefs", "--dataset_test_split", "test_prefs"])
    assert cfg.train_files == ["HuggingFaceH4/ultrafeedback_binarized[train_prefs]"]
    assert cfg.eval_files == ["HuggingFaceH4/ultrafeedback_binarized[test_prefs]"]
    folder = tmp_path / "pairs"
    folder.mkdir()
    cfg = parse_dpo(["--pretrain", "demo", "--dataset", f"{folder},owner/b", "--eval_dataset", "owner/c",
                     "--eval_split=validation", "--dataset_split", "train"])
    assert cfg.train_files == [str(folder), "owner/b"] and cfg.eval_files == ["owner/c[validation]"]
    rm = parse_rm(["--pretrain", "demo", "--dataset", "owner/prefs", "--train_split", "dev"])
    assert rm.helpful_train_file == "owner/prefs[dev]"
    capsys.readouterr()
    data = _write(tmp_path / "rows.jsonl", [{"prompt": "1+1?", "completion": "2"}])
    assert parse_sft(["--pretrain", "demo", "--dataset", data, "--train_split", "dev"]).train_files == [data]
    assert "note: the split 'dev' changes nothing for .jsonl/.json/.parquet files" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--eval_split needs a value"):
        parse_dpo(["--pretrain", "demo", "--eval_split"])


def test_trls_multi_loss_flags_take_several_words(capsys):
    cfg = parse_dpo(["--model_name_or_path", "demo", "--loss_type", "sigmoid", "bco_pair", "sft", "--loss_weights",
                     "0.8", "0.2", "1.0", "beta=0.2"])
    assert (cfg.loss_type, cfg.loss_weights, cfg.beta) == (["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0], 0.2)
    assert parse_dpo(["--pretrain", "demo", "--loss_type", "ipo", "beta=0.3"]).loss_type == "ipo"  # one word: as was


def test_input_template_reads_as_openrlhf_writes_it(capsys):
    """--input_template is a key of the four commands (OpenRLHF's empty one: the prompt as it is, '{}'); a line in
    OpenRLHF's spelling without --apply_chat_template takes their script's text (train_sft's and train_kto's
    template, train_rm's and train_dpo's plain prompt, rm and dpo off the chat template), with it none of that;
    beside the chat template a template is said to be ignored; our own keys keep rm's and dpo's chat template."""
    template = "User: {}\nAssistant: "
    for parse in (parse_sft, parse_kto, parse_rm, parse_dpo):
        assert parse(["--dataset", "d.jsonl", "--input_template", "Q: {}\nA: "]).input_template == "Q: {}\nA: "
        assert parse(["--dataset", "d.jsonl", "--input_template", "### Q #1:\n{}\n"]).input_template == (
            "### Q #1:\n{}\n")  # YAML would read # as a comment
    assert [parse(["--dataset", "d.jsonl"]).input_template for parse in (parse_sft, parse_kto)] == [template] * 2
    for parse in (parse_rm, parse_dpo):
        cfg = parse(["--pretrain", "demo"])
        assert (cfg.apply_chat_template, cfg.input_template) == (False, "{}")
        assert parse(["--pretrain", "demo", "--input_template", ""]).input_template == "{}"
        cfg = parse(["--pretrain", "demo", "--apply_chat_template"])
        assert (cfg.apply_chat_template, cfg.input_template) == (True, None)
        assert (parse([]).apply_chat_template, parse([]).input_template) == (True, None)
        assert parse(["--apply_chat_template", "false"]).apply_chat_template is False
    assert parse_sft(["--dataset", "d.jsonl", "--apply_chat_template"]).input_template is None
    capsys.readouterr()
    parse_dpo(["input_template=Q: {}"])
    parse_sft(["train_files=[d.jsonl]", "--input_template", "Q: {}\\nA: "])
    assert capsys.readouterr().err.splitlines() == [
        "alignrl: note: input_template is ignored: the chat template renders the prompts (apply_chat_template=true), "
        "as OpenRLHF ignores --input_template beside --apply_chat_template",
        "alignrl: note: input_template holds the two characters \\n, not a newline: in bash pass "
        "$'User: {}\\nAssistant: '"]


def test_trls_ipo_dataset_config_and_splits_of_one_dataset(capsys):
    """TRL's ipo is on token means; --dataset_config names the configuration (`name#config`); a bracketed dataset keeps
    its brackets; a split flag without the dataset flag it belongs to is one line."""
    cfg = parse_dpo(["--model_name_or_path", "m", "--dataset_name", "openai/gsm8k", "--dataset_config", "main",
                     "--loss_type", "ipo"])
    assert (cfg.loss_type, cfg.train_files, cfg.apply_chat_template) == ("ipo_token_mean", ["openai/gsm8k#main"], False)
    assert cfg.eval_files == ["openai/gsm8k#main"]  # its test split, when the config loads
    assert "note: TRL's ipo is on token means" in capsys.readouterr().err
    assert parse_dpo(["--model_name_or_path", "m", "--loss_type", "sigmoid", "ipo"]).loss_type == [
        "sigmoid", "ipo_token_mean"]
    assert parse_dpo(["--pretrain", "m", "--ipo"]).loss_type == "ipo"  # OpenRLHF's: on sums
    rm = parse_rm(["--pretrain", "m", "--dataset", "owner/x[dev]", "--eval_split", "other"])
    assert (rm.helpful_train_file, rm.helpful_eval_file) == ("owner/x[dev]", "owner/x[other]")
    with pytest.raises(ConfigError, match="a held-out split flag picks from the dataset named by --dataset"):
        parse_dpo(["--pretrain", "m", "eval_files=[a/b]", "--eval_split", "dev"])
    with pytest.raises(ConfigError, match="a training split flag picks"):
        parse_sft(["--pretrain", "m", "train_files=[a/b]", "--dataset_split", "dev"])


@pytest.mark.parametrize(("ratio", "steps", "expected"), [(0.03, 10, 1), (0.1, 25, 3), (0.1, 20, 2), (0.0, 20, 0)])
def test_a_warm_up_ratio_rounds_up_to_whole_optimizer_steps(monkeypatch, ratio, steps, expected):
    """OpenRLHF's math.ceil(max_steps * lr_warmup_ratio) and transformers' get_warmup_steps both round a
    fraction of a step up: 3% of 10 steps is one step of warm-up, not none."""
    import torch

    from alignrl.preference import common
    from alignrl.train import engines

    specs = []
    monkeypatch.setattr(engines, "build_engine", lambda strategy, model, spec, env, **kw: specs.append(spec))
    cfg = DPOConfig(warmup_ratio=ratio)
    common.build_engine_for(cfg, torch.nn.Linear(2, 2), env=None, total_steps=steps)
    assert specs[0].warmup_steps == expected
