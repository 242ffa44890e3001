"""GKD's on-policy part of `alignrl train kd` (`preference.kd_onpolicy`): the per-step draw is the same on every rank
and on a resume, a generated step trains the sampled tokens alone (its prompt untrained, the prompt being the tokens
before the last trained span) over their count on the whole step (every rank's), seq_kd samples from the teacher,
sampling is plain (no generation_config leaks in, no id beyond either head) with each row's draws its own, the loss on
generations is the distillation term alone and `temperature` leaves it as it is, lmbda=0 trains exactly as before,
TRL's flags read and the refusals are one line each, the rows' before any model loads; short real runs on the tiny
model. Two ranks: tests/test_kd_two_ranks.py."""

import itertools
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from alignrl.config import ConfigError
from alignrl.data.sft_rows import EncodedRow, collate_rows
from alignrl.preference.kd_cli import kd_main, parse_kd
from alignrl.preference.kd_onpolicy import (OnPolicy, RowSampler, check_rows, draws_student, prompts_of,
                                            row_seed, sample)

ROWS = [{"prompt": f"count from {i}", "completion": " ".join(str(i + k) for k in range(1 + i % 4))} for i in range(8)]
TRL_LINE = ["--model_name_or_path", "s", "--teacher_model_name_or_path", "t", "--dataset_name", "a.jsonl"]
PAD, EOS = 0, 2


def test_the_draw_is_the_same_on_every_rank_and_on_a_resume():
    """Seeded by (seed, step) alone: a fresh call (another rank, a resumed run) draws the same; lmbda 0 never,
    1 always; the fraction follows lmbda."""
    draws = [draws_student(42, step, 0.3) for step in range(400)]
    assert draws == [draws_student(42, step, 0.3) for step in range(400)]
    assert 0.22 < sum(draws) / 400 < 0.38
    assert draws != [draws_student(7, step, 0.3) for step in range(400)]  # the seed matters
    assert not any(draws_student(42, s, 0.0) for s in range(100)) and all(draws_student(42, s, 1.0) for s in range(100))


class _Sampler(torch.nn.Module):
    """A stand-in model whose `generate` appends its own tokens to each left-padded prompt (then pad), recording
    what it was given: which model samples, and what it sees, is what the tests read."""

    def __init__(self, tokens: list[int]):
        super().__init__()
        self.tokens, self.calls = tokens, []

    def generate(self, input_ids, attention_mask, **kw):
        self.calls.append((input_ids.clone(), attention_mask.clone(), kw, self.training))
        new = torch.tensor(self.tokens + [PAD] * 3).expand(len(input_ids), -1)
        return torch.cat([input_ids, new], dim=1)


def _setup(lmbda: float, seq_kd: bool, accum: int = 2):
    cfg = parse_kd(["teacher_model_path=t", "train_files=[a.jsonl]", f"lmbda={lmbda}", f"seq_kd={seq_kd}",
                    f"gradient_accumulation_steps={accum}", "batch_size=2", "max_new_tokens=7", "temperature=0.7"])
    rows = [EncodedRow([5 + i, 6, 7] + [10 + i] * (1 + i % 2) + [EOS], [False] * 3 + [True] * (2 + i % 2), i)
            for i in range(8)]
    on = OnPolicy(cfg)
    student, on.teacher = _Sampler([40, 41, EOS, 42]), _Sampler([50, EOS])
    student.train()
    env = SimpleNamespace(rank=0, world_size=1, distributed=False, device=torch.device("cpu"))
    loader = on(lambda epoch: (collate_rows(rows[i:i + 2], PAD, 99.0) for i in range(0, 8, 2)),
                SimpleNamespace(model=student), rows, SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS), env,
                SimpleNamespace(print=lambda *_: None))
    return on, student, rows, loader


def test_lmbda_one_trains_on_the_students_generations_over_their_count():
    on, student, rows, loader = _setup(1.0, False)
    batches, metrics = [], []
    for item in loader(0):
        batches.append(item.to(torch.device("cpu")))
        metrics.append(on.metrics())
    assert len(batches) == 4 and len(student.calls) == 4 and not on.teacher.calls
    ids, mask, kw, training = student.calls[0]
    assert ids.tolist() == [[5, 6, 7], [6, 6, 7]] and mask.all()  # the prompts: the tokens before the first trained
    (sampler,) = kw["logits_processor"]  # greedy decoding of what RowSampler draws: plain sampling at 0.7
    assert (kw["do_sample"], sampler.temperature, sampler.limit, kw["max_new_tokens"], kw["synced_gpus"]) == (
        False, 0.7, None, 7, False) and (kw["pad_token_id"], kw["eos_token_id"]) == (PAD, EOS) and not training
    assert sampler.seeds == [row_seed(42, 0, 0), row_seed(42, 0, 1)]  # the rows' own: (seed, step, row)
    assert student.training  # back to training after sampling
    first = batches[0]
    # each row: its prompt untrained, the sampled tokens up to and including the first eos trained, nothing after
    assert first.input_ids[0].tolist() == [5, 6, 7, 40, 41, EOS]
    assert first.loss_mask[0].tolist() == [False] * 3 + [True] * 3
    assert all(b.global_tokens == 3 * 4 for b in batches[:2])  # this step's 4 rows × 3 sampled tokens
    assert metrics[0] == {"on_policy": 1.0, "completion_length": 3.0}


def test_seq_kd_samples_from_the_teacher_and_lmbda_still_takes_the_students():
    on, student, rows, loader = _setup(0.0, True, accum=1)
    got = [item.to(torch.device("cpu")) for item in loader(0)]
    assert len(on.teacher.calls) == 4 and not student.calls
    assert got[0].input_ids[1].tolist() == [6, 6, 7, 50, EOS] and got[0].global_tokens == 4  # 2 rows × 2 tokens
    assert on.metrics()["on_policy"] == 0.0
    on, student, rows, loader = _setup(1.0, True, accum=1)
    [item.to(torch.device("cpu")) for item in loader(0)]
    assert len(student.calls) == 4 and not on.teacher.calls


def test_a_skipped_step_is_never_generated_for_and_a_dataset_step_keeps_its_rows():
    on, student, rows, loader = _setup(1.0, False)
    items = list(loader(0))
    items[2].to(torch.device("cpu"))  # the second step alone (a resumed run skips the first)
    assert len(student.calls) == 2
    on, student, rows, loader = _setup(0.5, False)
    kept = [(draws_student(on.cfg.seed, i // 2, 0.5), item.to(torch.device("cpu"))) for i, item in
            enumerate(loader(0))]
    plain = [b for drawn, b in kept if not drawn]
    assert plain and all(b.global_tokens == 99.0 for b in plain)  # the rows' own batches, as collated


def test_a_rows_draws_are_its_own_and_follow_the_tempered_distribution():
    """RowSampler: a row's pick depends on its seed and scores alone (not its neighbours or place in the batch), and
    the next call draws its next token; the picks follow softmax(scores / temperature); no id from `limit` on is
    drawn; it returns 0 at the pick and -inf elsewhere, which greedy decoding takes."""
    scores = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1], [0.25] * 4]))
    one = RowSampler([5, 6, 7], 1.0)(None, scores)
    assert (one == 0).sum(-1).tolist() == [1, 1, 1] and one.isinf().sum(-1).tolist() == [3, 3, 3]
    alone = RowSampler([6], 1.0)(None, scores[1:2])
    swapped = RowSampler([7, 5, 6], 1.0)(None, scores[[2, 0, 1]])
    assert alone.argmax(-1).item() == one[1].argmax().item()
    assert swapped.argmax(-1).tolist() == one.argmax(-1)[[2, 0, 1]].tolist()
    rows = scores[:1].expand(4000, -1)
    many = RowSampler(list(range(4000)), 0.5)
    first, second = many(None, rows).argmax(-1), many(None, rows).argmax(-1)
    assert not torch.equal(first, second)  # each row's generator goes on to its next draw
    tempered = torch.softmax(scores[0] / 0.5, -1)
    freq = torch.bincount(torch.cat([first, second]), minlength=4) / 8000
    assert torch.allclose(freq, tempered, atol=0.02), (freq, tempered)
    capped = RowSampler(list(range(500)), 10.0, limit=2)(None, rows[:500]).argmax(-1)
    assert set(capped.tolist()) == {0, 1}


def test_trl_flags_read_and_the_refusals_are_one_line_each(capsys):
    cfg = parse_kd(TRL_LINE + ["--lmbda", "0.5", "--seq_kd", "--max_new_tokens", "64"])
    assert (cfg.lmbda, cfg.seq_kd, cfg.max_new_tokens, cfg.temperature, cfg.distil_temperature) == (
        0.5, True, 64, 0.9, 1.0)  # GKD's temperature samples; its loss runs at 1
    silent = parse_kd(TRL_LINE)
    assert silent.lmbda == 0.5 and "GKD's lmbda 0.5 where the line is silent" in capsys.readouterr().err
    assert parse_kd(["--pretrain", "s", "--teacher_model", "t", "--dataset", "a.jsonl"]).lmbda == 0.0
    assert parse_kd(TRL_LINE + ["lmbda=0"]).lmbda == 0.0
    ours = ["teacher_model_path=t", "train_files=[a.jsonl]"]
    assert parse_kd(ours).lmbda == 0.0
    with pytest.raises(ConfigError, match="^lmbda=0.5: .*packing=true lays rows end to end") as err:
        parse_kd(ours + ["lmbda=0.5", "packing=true"])
    assert "\n" not in str(err.value)
    for sharded in (["strategy=fsdp2"], ["strategy=deepspeed", "zero_stage=3"]):  # they generate in step
        assert parse_kd(ours + ["lmbda=0.5", *sharded]).lmbda == 0.5
    parse_kd(ours + ["strategy=deepspeed", "zero_stage=2", "seq_kd=true"])
    with pytest.raises(ConfigError, match="^seq_kd=true with kd_coef=0: .*distillation loss alone"):
        parse_kd(ours + ["seq_kd=true", "kd_coef=0"])
    cfg = parse_kd(ours + ["lmbda=0.5"])
    rows = {"has no prompt: its first token trains": EncodedRow([1, 2, 3], [True] * 3, 0),
            "has images": EncodedRow([1, 2], [False, True], 2, images=object())}
    for said, row in rows.items():
        with pytest.raises(ConfigError, match=f"^lmbda=0.5 generates .*training row {row.index} {said}") as err:
            check_rows([EncodedRow([1, 2], [False, True], 9), row], cfg)
        assert "\n" not in str(err.value)
    check_rows([EncodedRow([1, 2, 3, 4], [False, True, False, True], 1)], cfg)  # several spans: the last one's
    silent = parse_kd(TRL_LINE)  # GKD's lmbda where the line is silent: its refusals say where 0.5 came from
    with pytest.raises(ConfigError, match=r"^GKD's default lmbda 0.5 \(TRL's spelling\) generates .*"
                                          "assistant_only_loss=true, or set lmbda=0"):
        check_rows([EncodedRow([1, 2, 3], [True] * 3, 0)], silent)


def test_the_prompt_is_before_the_last_trained_span():
    """TRL's chat collator: every message before the last is the prompt; a row's earlier trained turns are in it."""
    rows = [EncodedRow([1, 2, 3, 4, 5, 6, 7], [False, True, False, False, True, True, False], 0),
            EncodedRow([8, 9, 10], [False, False, True], 1)]
    assert prompts_of(collate_rows(rows, PAD, 1.0)) == [[1, 2, 3, 4], [8, 9]]


def test_notes_say_only_what_the_line_set(tmp_path, capsys):
    """A TRL line with --lmbda 0 is not told about a temperature it never set; lmbda from a YAML file is not
    'where the line is silent'; a temperature the line sets with nothing to sample is said."""
    parse_kd(TRL_LINE + ["--lmbda", "0"])
    assert "note: temperature" not in capsys.readouterr().err
    (tmp_path / "kd.yaml").write_text("lmbda: 0.5\n")
    assert parse_kd(TRL_LINE + ["--config", str(tmp_path / "kd.yaml")]).lmbda == 0.5
    assert "GKD's lmbda 0.5 where the line is silent" not in capsys.readouterr().err
    parse_kd(TRL_LINE + ["--lmbda", "0", "--temperature", "0.7"])
    assert "note: temperature=0.7 samples the generations alone" in capsys.readouterr().err


def test_the_steps_token_count_is_every_ranks(monkeypatch):
    """A generated step's global_tokens: this rank's sampled trained tokens summed with the other ranks'
    (a stubbed all-reduce standing for a second rank with 5)."""
    import alignrl.runtime.env as runtime_env

    seen = []

    def other_rank_adds_five(env, values):
        seen.append(list(values))
        return [v + 5.0 for v in values]

    monkeypatch.setattr(runtime_env, "all_reduce_sum", other_rank_adds_five)
    on, student, rows, loader = _setup(1.0, False)
    first = [item.to(torch.device("cpu")) for item in itertools.islice(loader(0), 2)]
    assert seen == [[12.0]] and all(b.global_tokens == 12.0 + 5.0 for b in first)  # 4 rows × 3 sampled tokens


def test_plain_sampling_the_folders_generation_config_changes_nothing(tiny_model_dir):
    """generate would fill repetition_penalty, no_repeat_ngram_size, ... from the model folder's generation_config:
    set aside, a model whose config asks for them samples what one without does (seeded)."""
    from alignrl.models.loader import load_model

    model, tok = load_model(str(tiny_model_dir))
    cfg = parse_kd(["teacher_model_path=t", "train_files=[a.jsonl]", "lmbda=1", "temperature=0.05",
                    "max_new_tokens=12"])
    prompts = [tok("count from 3")["input_ids"], tok("hello")["input_ids"]]

    def drawn():
        return sample(model, prompts, tok.pad_token_id, tok.eos_token_id, cfg, torch.device("cpu"), [0, 1])

    plain, saved = drawn(), model.generation_config
    assert any(len(set(r)) < len(r) for r in plain)  # it repeats tokens: no_repeat_ngram_size=1 would change it
    try:
        model.generation_config = type(saved)(**{**saved.to_dict(), "repetition_penalty": 50.0,
                                                 "no_repeat_ngram_size": 1})
        assert drawn() == plain
    finally:
        model.generation_config = saved
    assert model.generation_config is saved


def _line(model: Path, tmp: Path, name: str, *extra: str) -> list[str]:
    (tmp / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return [f"model_path={model}", f"teacher_model_path={model}", f"train_files=[{tmp / 'train.jsonl'}]",
            "--output_dir", str(tmp / name), "--logging_dir", str(tmp / f"logs_{name}"), "report_to=[jsonl]",
            "log_every=1", "batch_size=4", "learning_rate=1e-3", "warmup_ratio=0", "max_length=40", *extra]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_a_short_run_with_lmbda_one_and_lmbda_zero_as_before(tiny_model_dir, tmp_path):
    """lmbda=1: every step on the student's generations, its loss distil_loss alone whatever kd_coef (GKD's)."""
    assert kd_main(_line(tiny_model_dir, tmp_path, "gen", "kd_coef=0.5", "max_steps=2", "lmbda=1",
                         "max_new_tokens=8")) == 0
    rows = [json.loads(x) for x in (tmp_path / "logs_gen" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["train/on_policy"] == 1.0 for r in rows)
    assert all(torch.isfinite(torch.tensor(r["train/distil_loss"])) for r in rows)
    assert all(r["train/loss"] == r["train/distil_loss"] and "train/gpt_loss" not in r for r in rows)
    assert all(0 < r["train/completion_length"] <= 8 for r in rows)
    res = json.loads((tmp_path / "gen" / "eval_results.json").read_text())
    assert (res["lmbda"], res["seq_kd"], res["max_new_tokens"]) == (1.0, False, 8)
    # lmbda=0 (with the other generation keys set) trains exactly as a line without them
    assert kd_main(_line(tiny_model_dir, tmp_path, "plain", "max_steps=1")) == 0
    assert kd_main(_line(tiny_model_dir, tmp_path, "zero", "max_steps=1", "lmbda=0", "max_new_tokens=8")) == 0
    plain, zero = _weights(tmp_path / "plain"), _weights(tmp_path / "zero")
    assert all(torch.equal(plain[k], zero[k]) for k in plain)
    assert "train/on_policy" not in json.loads((tmp_path / "logs_zero" / "metrics.jsonl").read_text())


def test_a_wider_head_generates_only_shared_ids(tiny_model_dir, tmp_path):
    """A head padded to 320 entries for the 300-token tokenizer (matched, as check_vocab allows): the teacher's
    (seq_kd) and the student's (lmbda) samples hold only ids both models embed, even at a temperature that makes the
    padding entries as likely as any."""
    from alignrl.models.loader import load_model

    wide, tok = load_model(str(tiny_model_dir))
    wide.resize_token_embeddings(320)
    wide.save_pretrained(tmp_path / "wide")
    tok.save_pretrained(tmp_path / "wide")  # the student's folder: its tokenizer with it
    assert kd_main(_line(tiny_model_dir, tmp_path, "seq", f"teacher_model_path={tmp_path / 'wide'}", "seq_kd=true",
                         "temperature=50", "max_new_tokens=16", "max_steps=1")) == 0
    # a wider student's own generations, for a teacher of the tokenizer's size
    assert kd_main(_line(tiny_model_dir, tmp_path, "own", f"model_path={tmp_path / 'wide'}", "lmbda=1",
                         "temperature=50", "max_new_tokens=16", "max_steps=1")) == 0


def test_rows_with_no_prompt_are_refused_before_any_model_loads(tiny_model_dir, tmp_path, monkeypatch):
    """The layout check runs right after the rows are encoded: in the `--nproc` dry run, and in a run before the
    student (or the teacher) loads."""
    from alignrl.preference import common
    from alignrl.preference.kd import train_kd

    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"hello {i}"}) + "\n" for i in range(8)))
    cfg = parse_kd([f"model_path={tiny_model_dir}", f"teacher_model_path={tiny_model_dir}", f"train_files=[{text}]",
                    "lmbda=0.5", "batch_size=2"])
    with pytest.raises(ConfigError, match="^lmbda=0.5 generates .*training row 0 has no prompt"):
        train_kd(cfg, dry_run_world=2)

    def no_model(*_a, **_k):
        raise AssertionError("a model loaded before the rows were checked")

    monkeypatch.setattr(common, "trainable_causal_lm", no_model)
    with pytest.raises(ConfigError, match="training row 0 has no prompt"):
        train_kd(replace(cfg, output_dir=str(tmp_path / "out"), logging_dir=str(tmp_path / "logs")))


def test_sampling_temperature_leaves_the_loss_and_distil_temperature_changes_it(tiny_model_dir):
    """On a generated step's batch: `temperature` samples only (the same loss), `distil_temperature` divides the
    logits of the loss (another)."""
    from alignrl.models.loader import load_model
    from alignrl.preference.kd import distillation

    student, tok = load_model(str(tiny_model_dir))
    batch = collate_rows([EncodedRow([5, 6, 7, 40, 41, EOS], [False] * 3 + [True] * 3, 0)], PAD, 3.0)
    env, quiet = SimpleNamespace(device=torch.device("cpu")), SimpleNamespace(print=lambda *_: None)

    def loss(*keys: str) -> float:
        cfg = parse_kd([f"teacher_model_path={tiny_model_dir}", "train_files=[a.jsonl]", "lmbda=1",
                        *keys])
        on = OnPolicy(cfg)
        on.generated = True
        summed = distillation(cfg, student, tok, env, quiet, {}, on)
        return float(summed(student, batch)[0].detach())

    base = loss("temperature=1")
    assert loss("temperature=0.3") == base and abs(loss("distil_temperature=0.2") - base) > 0.1
