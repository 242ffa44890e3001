"""`alignrl train rm` and `alignrl train dpo` before any training: their configs and flags, the one-line refusals of
bad input, and the checks that a reward or cost model folder is the kind each setting takes."""

import json
from pathlib import Path

import pytest
import torch

from alignrl.config import ConfigError
from alignrl.preference import rm
from alignrl.preference.cli import DPOConfig, RMConfig, dpo_main, parse_dpo, parse_rm, rm_main

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv, expect", [
    (["--task", "helpful", "helpful_train_file=/nope/x.jsonl"], "data file not found: /nope/x.jsonl (set "
     "helpful_train_file to an existing"),
    (["--learning_rate"], "--learning_rate needs a value (--learning_rate VALUE)"),
    (["--beta", "0.1"], "--beta is a setting of another of the offline trainers (rm, dpo), not of this one"),
    (["--task", "helpful", "bogus_key=1"], "unknown config key 'bogus_key'"),
    (["--task", "helpful", "epoch=1"], "unknown config key 'epoch' (did you mean 'epochs'?); allowed: "),
    (["--task", "helpful", "batch_size=abc"], "bad value for 'batch_size'"),
    (["--task", "helpful", "strategy=tpu"], "strategy='tpu' is not allowed"),
    (["--task", "everything"], "invalid choice: 'everything'"),
    (["--config", "/nope.yaml"], "config file not found: /nope.yaml"),
    (["--task", "helpful", "max_train_pairs=3"], "fewer than one global batch"),
    (["--nproc", "x"], "--nproc 'x'"),
])
def test_rm_bad_input_is_one_line_exit_2(argv, expect, capsys):
    assert rm_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("alignrl: error:") and expect in err and "\n" not in err and "Traceback" not in err


def test_flat_config_layers_and_bf16_spellings(tmp_path):
    from alignrl.preference.cli import load_flat_config
    from alignrl.preference.common import use_bf16

    cfg = load_flat_config(RMConfig, str(REPO / "configs/rm_config.yaml"), ["epochs=3", "bf16=false"],
                           {"task": "harmless", "output_dir": None})
    assert (cfg.task, cfg.epochs, cfg.bf16, cfg.model_path) == ("harmless", 3, "false", "demo")
    assert not use_bf16(cfg)
    yaml = tmp_path / "c.yaml"
    yaml.write_text("bf16: true\nbatch_size: 2\n")
    cfg = load_flat_config(DPOConfig, str(yaml), [], {"loss_type": "ipo"})
    assert (cfg.bf16, cfg.batch_size, cfg.loss_type) == ("true", 2, "ipo")


def test_cost_model_needs_labels_and_safe_dpo_needs_scorers(tmp_path, capsys):
    unlabelled = tmp_path / "u.jsonl"
    unlabelled.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    assert rm_main(["--task", "harmless", f"harmless_train_file={unlabelled}"]) == 2
    assert "u.jsonl:1: row is missing is_chosen_safe/is_rejected_safe" in capsys.readouterr().err
    assert dpo_main(["--config", str(REPO / "configs/dpo_config.yaml"), f"helpful_rm={tmp_path / 'none'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "helpful_rm=" in err and "scripts/train_rm_distributed.sh helpful" in err and "\n" not in err


def _scorer_folder(path: Path, info: dict | None) -> str:
    """A folder that passes for a trained scorer up to its kind: config.json and, unless None, alignrl_score.json."""
    path.mkdir()
    (path / "config.json").write_text("{}")
    if info is not None:
        (path / rm.SCORE_INFO).write_text(json.dumps(info))
    return str(path)


def test_safe_dpo_refuses_swapped_scorers_before_training(tmp_path, capsys):
    helpful = _scorer_folder(tmp_path / "helpful_rm", {"model_type": "reward", "task": "helpful"})
    harmless = _scorer_folder(tmp_path / "harmless_rm", {"model_type": "cost", "task": "harmless"})
    base = ["--config", str(REPO / "configs/dpo_config.yaml"), "--output_dir", str(tmp_path / "out")]
    assert dpo_main([*base, f"helpful_rm={harmless}", f"harmless_rm={helpful}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"alignrl: error: helpful_rm={harmless} is a harmlessness cost model ({rm.SCORE_INFO} "
                   "model_type=cost, task=harmless); helpful_rm takes a helpfulness reward model (--task helpful): "
                   "swap helpful_rm and harmless_rm?")
    assert not (tmp_path / "out").exists()  # refused before any model loaded or trained
    assert dpo_main([*base, f"helpful_rm={helpful}", f"harmless_rm={helpful}"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"harmless_rm={helpful} is a helpfulness reward model" in err and "\n" not in err


def test_scorer_kind_accepts_fitting_and_foreign_scorers(tmp_path):
    from alignrl.preference.dpo import check_scorers
    from alignrl.config import ConfigError

    foreign = _scorer_folder(tmp_path / "foreign", None)  # a scorer from elsewhere: taken on trust
    safer = _scorer_folder(tmp_path / "safer", {"model_type": "reward", "task": "harmless"})  # DPO negates it
    check_scorers(DPOConfig(helpful_rm=foreign, harmless_rm=safer))
    with pytest.raises(ConfigError, match="safety.cost_model=.* is a harmlessness reward model"):
        rm.check_scorer_kind("safety.cost_model", safer)  # the RL cost penalty would punish safe answers
    cost = _scorer_folder(tmp_path / "cost", {"model_type": "cost"})
    with pytest.raises(ConfigError, match="a cost model goes in safety.cost_model"):
        rm.check_scorer_kind("algorithm.reward_model", cost)


def test_rl_loop_refuses_a_cost_model_as_its_reward_model(tmp_path):
    from alignrl.placements.build import build_rewards
    from alignrl.config import ConfigError, load_config

    cost = _scorer_folder(tmp_path / "cost", {"model_type": "cost", "task": "harmless"})
    cfg = load_config(None, [f"algorithm.reward_model={cost}"])
    with pytest.raises(ConfigError, match=r"algorithm.reward_model=.* is a harmlessness cost model"):
        build_rewards(cfg, None, torch.device("cpu"))
    # the command line refuses it before the policy loads, in one line
    from alignrl.cli import preflight

    with pytest.raises(ConfigError, match=r"algorithm.reward_model=.* is a harmlessness cost model"):
        preflight(cfg, 1)


def test_overrides_may_come_before_between_or_after_the_flags(tmp_path):
    """`alignrl train rm|dpo`: key=value overrides anywhere on the line, as for the RL commands."""
    cfg = parse_rm(["epochs=3", "--task", "harmless", "max_train_pairs=8", "--output_dir", str(tmp_path / "x"),
                    "learning_rate=0.5"])
    assert (cfg.epochs, cfg.task, cfg.max_train_pairs, cfg.output_dir, cfg.learning_rate) == (
        3, "harmless", 8, str(tmp_path / "x"), 0.5)
    cfg = parse_dpo(["loss_type=ipo", "--output_dir", str(tmp_path / "y"), "beta=0.2", "--precompute_ref_log_probs"])
    assert (cfg.loss_type, cfg.output_dir, cfg.beta, cfg.precompute_ref_log_probs) == ("ipo", str(tmp_path / "y"), 0.2,
                                                                                        True)


def test_label_smoothing_on_a_loss_that_ignores_it_is_one_line(tmp_path):
    assert parse_dpo(["loss_type=sigmoid", "label_smoothing=0.1"]).label_smoothing == 0.1  # conservative DPO
    with pytest.raises(ConfigError, match=r"label_smoothing=0.1 is read only by loss_type sigmoid, cdpo, robust, "
                                          r"exo_pair, aot, aot_pair, simpo, cpo; not ipo"):
        parse_dpo(["loss_type=ipo", "label_smoothing=0.1"])


def test_trls_and_openrlhfs_spellings_of_the_dpo_loss(tmp_path):
    cfg = parse_dpo(["--loss_type", "robust", "--beta", "0.2", "--label_smoothing", "0.1", "--rpo_alpha", "0.5"])
    assert (cfg.loss_type, cfg.beta, cfg.label_smoothing, cfg.nll_loss_coef) == ("robust", 0.2, 0.1, 0.5)
    assert parse_dpo(["--nll_loss_coef", "0.3"]).nll_loss_coef == 0.3  # OpenRLHF's flag
    assert parse_dpo(["rpo_alpha=0.25", "loss_type=discopop", "discopop_tau=0.1"]).nll_loss_coef == 0.25
    with pytest.raises(ConfigError, match="loss_type=robust needs label_smoothing below 0.5"):
        parse_dpo(["loss_type=robust", "label_smoothing=0.5"])
    cfg = parse_dpo(["--loss_type", "simpo", "--simpo_gamma", "1.0", "--cpo_alpha", "0.2"])
    assert (cfg.simpo_gamma, cfg.nll_loss_coef) == (1.0, 0.2)
    assert parse_dpo(["loss_type=cpo", "cpo_alpha=1.0"]).nll_loss_coef == 1.0  # TRL's CPOConfig default


@pytest.mark.parametrize("setting", ["ref_model_path=x", "sync_ref_model=true", "precompute_ref_log_probs=true",
                                     "kl_coeff=0.1"])
def test_a_reference_setting_with_a_reference_free_loss_is_one_line(setting):
    with pytest.raises(ConfigError, match="loss_type=orpo uses no reference model, so " + setting.split("=")[0]):
        parse_dpo(["loss_type=orpo", setting])


def test_the_nll_term_is_each_chosen_responses_token_mean():
    from types import SimpleNamespace

    from alignrl.preference.pair_logps import chosen_nll

    # two pairs: chosen rows 0-1 with 3 and 1 response tokens, rejected rows 2-3
    batch = SimpleNamespace(n_pairs=2, response_mask=torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]]).bool())
    assert chosen_nll(torch.tensor([-6.0, -2.0]), batch, "sum").tolist() == [2.0, 2.0]
    assert chosen_nll(torch.tensor([-0.5, -1.5]), batch, "sequence_mean").tolist() == [0.5, 1.5]


def test_the_dpo_loss_choices_are_the_losses_there_are():
    from alignrl.preference.cli import DPO_LOSS_NAMES
    from alignrl.core.preference import DPO_LOSSES

    assert DPO_LOSS_NAMES == tuple(DPO_LOSSES)


@pytest.mark.parametrize("flag", ["--logging_dir", "--output_dir"])
def test_a_folder_flag_under_a_file_is_one_line_before_training(flag, tmp_path, cli_in_process):
    file = tmp_path / "notes.txt"
    file.write_text("a file, not a folder")
    p = cli_in_process("train", "rm", flag, str(file / "sub"), "model_path=demo")
    assert p.returncode == 2 and p.stderr.strip() == (
        f"alignrl: error: {flag}: {file} is a file, so {file / 'sub'} cannot be a folder; move the file or set "
        f"{flag} to another path"), p.stderr
    assert file.read_text() == "a file, not a folder"


def test_preference_training_turns_dropout_off():
    """As TRL's disable_dropout: the DPO policy is compared with a reference in eval mode, and a reward model's
    pairwise scores would otherwise carry two different dropout masks."""
    from alignrl.preference.common import prepare_trainable

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.1), torch.nn.Linear(3, 1))
    model.config = type("Config", (), {"use_cache": True})()
    prepare_trainable(model, RMConfig())
    assert [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)] == [0.0]
    assert model.config.use_cache is False


def test_folders_that_cannot_be_written_are_one_line_before_training(cli_in_process):
    p = cli_in_process("train", "rm", "--output_dir", "/proc/alignrl-out", "model_path=demo")
    assert p.returncode == 2 and p.stderr.strip().startswith(
        "alignrl: error: --output_dir: cannot write under /proc/alignrl-out (/proc: "), p.stderr


def test_a_scorer_folder_is_refused_as_a_policy(tmp_path):
    from alignrl.models.loader import ModelError, load_causal_lm

    cost = _scorer_folder(tmp_path / "harmless_rm", {"model_type": "cost", "task": "harmless"})
    with pytest.raises(ModelError) as e:  # transformers loaded its backbone under a new, random LM head
        load_causal_lm(Path(cost), key="model_path")
    assert str(e.value).startswith(f"model_path={cost} is a cost model saved by `alignrl train rm` "
                                   f"({rm.SCORE_INFO}): it scores text and cannot write it")


def test_orpo_trains_without_a_reference_on_token_means(tiny_model_dir, tmp_path, monkeypatch):
    """ORPO loads no reference model, and its first loss is the chosen NLL minus λ·log σ(log odds) of the policy's
    token-mean log-probs: recomputed here from the initial model."""
    from alignrl.data.preference import collate_pairs, encode_pairs, load_pairs
    from alignrl.models.loader import load_model
    from alignrl.preference import dpo
    from alignrl.preference.pair_logps import chosen_nll, pair_logps, token_means

    made = []
    monkeypatch.setattr(dpo._Reference, "logps", lambda *a, **k: made.append(1))  # never asked for
    argv = [f"model_path={tiny_model_dir}", "--output_dir", str(tmp_path / "out"), "--logging_dir", str(tmp_path / "l"),
            "loss_type=orpo", "beta=0.25", "max_train_pairs=4", "max_eval_pairs=2", "batch_size=4", "max_steps=1",
            "warmup_ratio=0", "log_every=1", "report_to=[jsonl]", "bf16=false", "train_files=[builtin:helpful]",
            "eval_files=[builtin:helpful_test]"]
    assert dpo_main(argv) == 0 and not made
    first = json.loads((tmp_path / "l" / "metrics.jsonl").read_text().splitlines()[0])
    model, tok = load_model(str(tiny_model_dir))
    pairs = load_pairs("builtin:helpful", "better", 4)
    batch = collate_pairs(encode_pairs(tok, pairs, 256)[0], pairs, tok.pad_token_id)  # the one micro-batch
    with torch.no_grad():
        c, r, _ = pair_logps(model, batch)
        nll = chosen_nll(c, batch, "sum")
        c, r = token_means(c, r, batch, "sum")
    odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    expect = (nll - 0.25 * torch.nn.functional.logsigmoid(odds)).mean()
    assert first["loss"] == pytest.approx(float(expect), rel=1e-4)


def test_a_dpo_step_adds_the_nll_term_to_the_loss(tiny_model_dir, tmp_path):
    """loss_type=apo_zero with TRL's --rpo_alpha: the step's loss is the preference loss plus α times the chosen
    responses' NLL, both logged."""
    argv = [f"model_path={tiny_model_dir}", "--output_dir", str(tmp_path / "out"), "--logging_dir", str(tmp_path / "l"),
            "--loss_type", "apo_zero", "--rpo_alpha", "0.5", "max_train_pairs=4", "max_eval_pairs=2", "batch_size=4",
            "max_steps=1", "warmup_ratio=0", "log_every=1", "report_to=[jsonl]", "bf16=false"]
    assert dpo_main(argv) == 0
    first = json.loads((tmp_path / "l" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["nll_loss"] > 0 and first["dpo/loss"] == pytest.approx(1.0)  # apo_zero at the reference: 1 - ½ + ½
    assert first["loss"] == pytest.approx(first["dpo/loss"] + 0.5 * first["nll_loss"], rel=1e-5)
