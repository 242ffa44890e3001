"""PPO-ptx (OpenRLHF's --pretrain_data / --ptx_coef): pretraining texts read and tokenized as OpenRLHF's pretraining
dataset does, their language-model loss, the update's gradient with the term, and runs with it."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from alignrl.data.pretrain_text import PretrainTexts, load_pretrain_texts
from alignrl.data.row_formats import DataError
from alignrl.runtime.env import SINGLE
from alignrl.train.actor import Actor, PolicyLossSpec
from alignrl.train.engines import OptimSpec, build_engine
from alignrl.train.ptx import PretrainMix, language_model_loss
from test_actor import _experience

pytestmark = pytest.mark.timeout(300)
TEXTS = ["12 + 7 = 19.", "The sum of 3 and 4 is 7.", "9 - 2 = 7", "Eight times two is sixteen."]


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_texts_are_tokenized_whole_and_cut_as_openrlhfs_pretraining_rows(tiny_model, tmp_path):
    _, tok = tiny_model
    texts = load_pretrain_texts(_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in TEXTS + [" "]]), "text", tok, 5)
    want = [tok(t, add_special_tokens=False)["input_ids"][:5] for t in TEXTS]  # the blank text left out
    assert [texts.ids(r) for r in range(len(texts))] == want
    ids, mask = texts.batch([0, 3])
    assert ids.shape == mask.shape == (2, max(len(want[0]), len(want[3])))
    assert mask.sum(1).tolist() == [len(want[0]), len(want[3])] and ids[0, :len(want[0])].tolist() == want[0]
    files = [_jsonl(tmp_path / "a.jsonl", [{"text": TEXTS[0]}]), _jsonl(tmp_path / "b.jsonl", [{"text": TEXTS[1]}])]
    blended = load_pretrain_texts(files, "text", tok, 64, probs=[0.5, 0.5])
    assert set(blended.texts) == set(TEXTS[:2])


@pytest.mark.parametrize("rows, problem", [([{"content": "x y z"}], "no column 'text'"),
                                            ([{"text": ["x"]}], "is list, not text"),
                                            ([], "no text in column 'text'"), ([{"text": "  "}], "no text in")])
def test_bad_pretraining_rows_are_one_line(tiny_model, tmp_path, rows, problem):
    _, tok = tiny_model
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=problem) as e:
        load_pretrain_texts(str(path), "text", tok, 64)
    assert "\n" not in str(e.value)


def test_the_language_model_loss_is_the_token_mean_cross_entropy_of_the_attended_tokens(tiny_model):
    model, tok = tiny_model
    texts = PretrainTexts(TEXTS[:2], tok, 64, tok.pad_token_id)
    ids, mask = texts.batch([0, 1])
    rows = [texts.ids(0), texts.ids(1)]
    with torch.no_grad():
        got = language_model_loss(model, ids, mask)
        terms = []
        for row in rows:
            logits = model(input_ids=torch.tensor([row])).logits[0, :-1]
            terms.append(F.cross_entropy(logits, torch.tensor(row[1:]), reduction="sum"))
        one_token = language_model_loss(model, ids[:, :1], mask[:, :1])  # nothing to predict: zero, not NaN
    want = sum(terms) / sum(len(r) - 1 for r in rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert one_token.item() == 0.0


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _actor(model, ptx=None):
    """An actor whose step leaves its gradient unclipped in .grad (the clip would rescale the sum)."""
    return Actor(build_engine("single", model, OptimSpec(lr=1e-3, total_steps=10, grad_clip=1e9), SINGLE), ptx=ptx)


def _updated(model, exp, micro_batch: int, ptx=None):
    """A copy of `model` after one update of `exp` (step 3), its gradient left in .grad."""
    copied = copy.deepcopy(model)
    _actor(copied, ptx).update(exp, PolicyLossSpec(), mini_batch=4, micro_batch=micro_batch, epochs=1,
                               generator=torch.Generator().manual_seed(0), step=3)
    return copied


def test_the_update_adds_coef_times_the_texts_gradient(tiny_model):
    """With one micro-batch (its share of the tokens is 1) the step's gradient is the policy loss's plus coef x the
    drawn texts' language-model gradient; coef 0 leaves it as without the term."""
    model, tok = tiny_model
    exp = _experience(model, tok, [1.0, 0.0, 0.5, 0.0])
    texts = PretrainTexts(TEXTS, tok, 64, tok.pad_token_id)
    plain = _updated(model, exp, 4)
    for coef in (0.0, 0.3):
        mixed = _updated(model, exp, 4, PretrainMix(texts, coef, micro_batch=2, seed=5))
        by_hand = copy.deepcopy(model)
        ids, mask = PretrainMix(texts, coef, micro_batch=2, seed=5).for_step(3)()
        (coef * language_model_loss(by_hand, ids, mask)).backward()
        want = _grads(plain) + torch.cat([p.grad.flatten() for p in by_hand.parameters()])
        if coef == 0.0:
            assert torch.equal(_grads(mixed), _grads(plain))
        torch.testing.assert_close(_grads(mixed), want, rtol=1e-5, atol=1e-7)


def test_each_micro_batch_adds_its_texts_weighted_by_its_share_of_the_tokens(tiny_model, monkeypatch):
    """Two micro-batches: the step's gradient is the policy loss's plus coef x each micro-batch's share of the
    mini-batch's response tokens x its texts' gradient, and the shares add up to 1."""
    from alignrl.train import minibatch

    model, tok = tiny_model
    exp = _experience(model, tok, [1.0, 0.0, 0.5, 0.0])
    texts = PretrainTexts(TEXTS, tok, 64, tok.pad_token_id)
    plain = _updated(model, exp, 2)
    shares, follow = [], minibatch.MicroRun._followed

    def record(run, result, last):
        shares.append(result[1] / run.tokens)
        return follow(run, result, last)

    monkeypatch.setattr(minibatch.MicroRun, "_followed", record)
    mixed = _updated(model, exp, 2, PretrainMix(texts, 0.3, micro_batch=2, seed=5))
    assert len(shares) == 2 and sum(shares) == pytest.approx(1.0)
    by_hand, draw = copy.deepcopy(model), PretrainMix(texts, 0.3, micro_batch=2, seed=5).for_step(3)
    sum(0.3 * share * language_model_loss(by_hand, *draw()) for share in shares).backward()
    want = _grads(plain) + torch.cat([p.grad.flatten() for p in by_hand.parameters()])
    torch.testing.assert_close(_grads(mixed), want, rtol=1e-5, atol=1e-7)


def test_each_step_draws_its_own_texts_the_same_way_every_time():
    def pairs(text, **kw):  # a tokenizer whose text "i" is the ids [i, i + 1]
        return {"input_ids": [int(text), int(text) + 1]}

    texts = PretrainTexts([str(i) for i in range(10)], pairs, 8, 0)
    mix = PretrainMix(texts, 0.1, micro_batch=3, seed=1)
    first = [mix.for_step(4)()[0].tolist() for _ in range(2)]
    assert first[0] == first[1]  # a step's draws start over the same: a resumed run draws them again
    draw = mix.for_step(4)
    rows = [tuple(map(tuple, draw()[0].tolist())) for _ in range(4)]  # 12 draws of 10 texts: every text, cycling
    assert {r for batch in rows for r in batch} == {(i, i + 1) for i in range(10)}
    assert mix.for_step(5)()[0].tolist() != first[0]
    ranks = [PretrainMix(texts, 0.1, micro_batch=3, seed=1, rank=r, ranks=2).for_step(4) for r in (0, 1)]
    one = mix.for_step(4)
    assert [ranks[0]()[0].tolist(), ranks[1]()[0].tolist()] == [one()[0].tolist(), one()[0].tolist()]  # in turns


def test_openrlhfs_flags_are_the_ptx_keys(tmp_path):
    from alignrl.compat import openrlhf_flags as F
    from alignrl.compat import openrlhf_keys as K
    from alignrl.config import load_config

    a, b = (_jsonl(tmp_path / f"{n}.jsonl", [{"input": t} for t in TEXTS]) for n in "ab")
    base = ["--pretrain", "demo", "--micro_train_batch_size", "2", "--n_samples_per_prompt", "2",
            "--train_batch_size", "16", "--rollout_batch_size", "16", "--prompt_max_len", "32",
            "--generate_max_len", "16"]
    args = F.parser().parse_args(base + ["--pretrain_data", f"{a},{b}", "--pretrain_data_probs", "0.7,0.3",
                                         "--ptx_coef", "0.1", "--pretrain_split", "train"])
    F.check(args)
    p = load_config(None, K.overrides(args, False, 3)).ptx
    assert (p.data, p.data_probs, p.key, p.coef, p.max_length) == ([a, b], [0.7, 0.3], "input", 0.1, 0)
    assert not any("pretrain" in line for line in K.unused_here(args, gpus=False))
    capped = F.parser().parse_args(base + ["--pretrain_data", a, "--max_len", "24", "--input_key", "q"])
    p = load_config(None, K.overrides(capped, False, 3)).ptx
    assert (p.data, p.data_probs, p.key, p.max_length) == (a, [], "q", 24)


def test_a_run_with_pretraining_texts_trains_and_logs_their_loss(tiny_model_dir, tmp_path, cli_in_process):
    from conftest import SMALL_GRPO, run_settings

    texts = _jsonl(tmp_path / "texts.jsonl", [{"text": t} for t in TEXTS * 4])
    got = cli_in_process("train", "grpo", *SMALL_GRPO, f"model.path={tiny_model_dir}", f"ptx.data={texts}",
                         "ptx.coef=0.5", *run_settings(tmp_path, "ptx", 2))
    assert got.returncode == 0, got.stderr[-3000:] + got.stdout[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "ptx" / "logs" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["actor/ptx_loss"] for r in rows if "actor/ptx_loss" in r]
    assert len(losses) == 2 and all(0 < x < 50 for x in losses), losses
    bad = cli_in_process("train", "grpo", *SMALL_GRPO, f"model.path={tiny_model_dir}", f"ptx.data={texts}",
                         "ptx.key=content", *run_settings(tmp_path, "ptx_bad", 1))
    assert bad.returncode != 0 and "no column 'content'" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("strategy", ["ddp", "deepspeed"])
def test_pretraining_texts_train_on_two_ranks(strategy, tiny_model_dir, tmp_path):
    """The texts' backward after each micro-batch keeps the engines' accumulation (DDP's no_sync, DeepSpeed's
    boundary): two ranks train and log the texts' loss."""
    from test_distributed_loop import run

    texts = _jsonl(tmp_path / "texts.jsonl", [{"text": t} for t in TEXTS * 4])
    r = run(tiny_model_dir, tmp_path, strategy, strategy, 2, f"ptx.data={texts}", "ptx.coef=0.5")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / strategy / "logs" / "metrics.jsonl").read_text().splitlines()]
    losses = [x["actor/ptx_loss"] for x in rows if "actor/ptx_loss" in x]
    assert len(losses) == 2 and all(0 < x < 50 for x in losses), losses


@pytest.mark.parametrize("extra", [['ptx.data_probs=["x"]'], ["ptx.data_probs=[0.5]"], ["ptx.data_probs=[0.5,.nan]"]])
def test_bad_weights_are_one_line_before_any_model_loads(extra):
    from alignrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="ptx.data_probs=.* must be one finite weight above 0 per ptx.data file") as e:
        load_config(None, ["ptx.data=[a.jsonl,b.jsonl]", *extra])
    assert "\n" not in str(e.value)
