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
    texts = load_pretrain_texts(_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in TEXTS]), "text", tok, 5)
    assert texts.ids == [tok(t, add_special_tokens=False)["input_ids"][:5] for t in TEXTS]
    ids, mask = texts.batch([0, 3])
    assert ids.shape == mask.shape == (2, max(len(texts.ids[0]), len(texts.ids[3])))
    assert mask.sum(1).tolist() == [len(texts.ids[0]), len(texts.ids[3])]
    blended = load_pretrain_texts([_jsonl(tmp_path / "a.jsonl", [{"text": TEXTS[0]}]),
                                   _jsonl(tmp_path / "b.jsonl", [{"text": TEXTS[1]}])], "text", tok, 64, probs=[0.5, 0.5])
    assert set(map(tuple, blended.ids)) == {tuple(tok(t, add_special_tokens=False)["input_ids"]) for t in TEXTS[:2]}


@pytest.mark.parametrize("rows, problem", [([{"content": "x y z"}], "no column 'text'"),
                                            ([{"text": ["x"]}], "is list, not text"),
                                            ([], "no rows"), ([{"text": "x"}], "no text of two tokens or more")])
def test_bad_pretraining_rows_are_one_line(tiny_model, tmp_path, rows, problem):
    _, tok = tiny_model
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=problem) as e:
        load_pretrain_texts(str(path), "text", tok, 64)
    assert "\n" not in str(e.value)


def test_the_language_model_loss_is_the_token_mean_cross_entropy_of_the_attended_tokens(tiny_model):
    model, tok = tiny_model
    texts = PretrainTexts([tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS[:2]], tok.pad_token_id)
    ids, mask = texts.batch([0, 1])
    with torch.no_grad():
        got = language_model_loss(model, ids, mask)
        terms = []
        for row in texts.ids:
            logits = model(input_ids=torch.tensor([row])).logits[0, :-1]
            terms.append(F.cross_entropy(logits, torch.tensor(row[1:]), reduction="sum"))
    want = sum(terms) / sum(len(r) - 1 for r in texts.ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _actor(model, ptx=None):
    """An actor whose step leaves its gradient unclipped in .grad (the clip would rescale the sum)."""
    return Actor(build_engine("single", model, OptimSpec(lr=1e-3, total_steps=10, grad_clip=1e9), SINGLE), ptx=ptx)


def test_the_update_adds_coef_times_the_texts_gradient(tiny_model):
    """With one micro-batch (its share of the tokens is 1) the step's gradient is the policy loss's plus coef x the
    drawn texts' language-model gradient; coef 0 leaves it as without the term."""
    model, tok = tiny_model
    exp = _experience(model, tok, [1.0, 0.0, 0.5, 0.0])
    texts = PretrainTexts([tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS], tok.pad_token_id)
    kw = dict(mini_batch=4, micro_batch=4, epochs=1)
    plain = copy.deepcopy(model)
    _actor(plain).update(exp, PolicyLossSpec(), generator=torch.Generator().manual_seed(0), **kw)
    for coef in (0.0, 0.3):
        mixed = copy.deepcopy(model)
        _actor(mixed, PretrainMix(texts, coef, micro_batch=2, seed=5)).update(
            exp, PolicyLossSpec(), generator=torch.Generator().manual_seed(0), step=3, **kw)
        by_hand = copy.deepcopy(model)
        ids, mask = PretrainMix(texts, coef, micro_batch=2, seed=5).for_step(3)()
        (coef * language_model_loss(by_hand, ids, mask)).backward()
        want = _grads(plain) + torch.cat([p.grad.flatten() for p in by_hand.parameters()])
        if coef == 0.0:
            assert torch.equal(_grads(mixed), _grads(plain))
        torch.testing.assert_close(_grads(mixed), want, rtol=1e-5, atol=1e-7)


def test_each_step_draws_its_own_texts_the_same_way_every_time():
    texts = PretrainTexts([[i, i + 1] for i in range(10)], 0)
    mix = PretrainMix(texts, 0.1, micro_batch=3, seed=1)
    first = [mix.for_step(4)()[0].tolist() for _ in range(2)]
    assert first[0] == first[1]  # a step's draws start over the same: a resumed run draws them again
    draw = mix.for_step(4)
    rows = [tuple(map(tuple, draw()[0].tolist())) for _ in range(4)]  # 12 draws of 10 texts: every text, cycling
    assert {r for batch in rows for r in batch} == {(i, i + 1) for i in range(10)}
    assert mix.for_step(5)()[0].tolist() != first[0]
