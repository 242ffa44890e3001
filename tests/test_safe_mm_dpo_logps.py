"""The log-probabilities Safe-MM-DPO trains on (summed over response tokens, or the whole sequence's token mean) and
its KL term, against a plain forward of each row alone."""

import pytest
import torch

from alignrl.data.preference import collate_pairs, encode_pairs, load_pairs
from alignrl.preference.pair_logps import pair_logps, response_kl


@pytest.fixture(scope="module")
def batch_and_model(tiny_model):
    model, tok = tiny_model
    pairs = load_pairs("builtin:harmless_test", "safer", limit=3)
    batch = collate_pairs(encode_pairs(tok, pairs, 64)[0], pairs, tok.pad_token_id)
    return batch, model.eval()


def _row_logps(model, ids: list[int], first_scored: int) -> list[float]:
    """log p(token t | tokens < t) for t >= first_scored, one unpadded row."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[t - 1, ids[t]]) for t in range(max(first_scored, 1), len(ids))]


def test_sum_and_sequence_mean_match_each_row_alone(batch_and_model):
    batch, model = batch_and_model
    with torch.no_grad():
        s_c, s_r, _ = pair_logps(model, batch, "sum")
        m_c, m_r, _ = pair_logps(model, batch, "sequence_mean")
    for row in range(2 * batch.n_pairs):
        prompt = batch.prompt_ids[row][batch.prompt_mask[row]].tolist()
        response = batch.response_ids[row][batch.response_mask[row]].tolist()
        tokens = _row_logps(model, prompt + response, 0)
        want_sum = sum(_row_logps(model, prompt + response, len(prompt)))
        want_mean = sum(tokens) / len(tokens)  # every token with one before it: prompt and response
        got_sum = (s_c if row < batch.n_pairs else s_r)[row % batch.n_pairs].item()
        got_mean = (m_c if row < batch.n_pairs else m_r)[row % batch.n_pairs].item()
        assert got_sum == pytest.approx(want_sum, abs=1e-3) and got_mean == pytest.approx(want_mean, abs=1e-4)


def test_response_kl_is_the_exact_kl_over_real_tokens():
    g = torch.Generator().manual_seed(0)
    p, q = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    got = response_kl(p, q, mask)
    for i in range(2):
        kls = []
        for t in range(3):
            if mask[i, t]:
                a, b = torch.softmax(p[i, t], -1), torch.softmax(q[i, t], -1)
                kls.append(float((a * (a.log() - b.log())).sum()))
        assert got[i].item() == pytest.approx(sum(kls) / len(kls), rel=1e-5)
    assert response_kl(p, p, mask).abs().max().item() < 1e-6
