"""SFT packing and NEFTune on the tiny test model, in process: packed rows keep to themselves (logits, targets), a
model whose attention would mix them is refused, and NEFTune's noise has its scale, in training only."""

import pytest
import torch

from alignrl.config import ConfigError
from alignrl.data.sft_rows import SFTKeys, SFTRow, collate_rows, encode_rows
from alignrl.preference.sft_packing import NEFTune, best_fit, check_packable, collate_packed

ROWS = [SFTRow("x", prompt=f"count from {i}", completion=" ".join(str(i + k) for k in range(1 + i % 4)))
        for i in range(6)]


@pytest.fixture(scope="module")
def rows_and_model(tiny_model_dir):
    from alignrl.models.loader import load_causal_lm, load_tokenizer

    tok = load_tokenizer(tiny_model_dir, chat=False)
    encoded, _, _ = encode_rows(tok, ROWS, SFTKeys(completion_only=False), 64)  # every token, the first too
    return encoded, tok.pad_token_id, load_causal_lm(tiny_model_dir, "float32", "model_path")


def _segments(batch):
    """Each packed row's (sequence, start, end) in the batch's row order, filler left out."""
    out = []
    for r in range(batch.input_ids.shape[0]):
        starts = (batch.position_ids[r] == 0).nonzero().flatten().tolist() + [batch.input_ids.shape[1]]
        out += [(r, a, b) for a, b in zip(starts, starts[1:]) if batch.attention_mask[r, a]]
    return out


def test_best_fit_decreasing_fills_the_fullest_bin_that_fits():
    # 9, 6, 5 open three bins; 3 goes to the fuller of the two it fits (6: room 4, not 5: room 5); 1 fills the 9
    assert best_fit([5, 9, 3, 6, 1], 10) == [[1, 4], [3, 2], [0]]
    assert best_fit([12, 2], 10) == [[0], [1]]  # a row longer than a bin gets one of its own


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_rows_see_only_themselves_and_no_target_crosses_a_row(rows_and_model, attention):
    encoded, pad, model = rows_and_model
    packed, padded = collate_packed(encoded, pad, 1.0, 40), collate_rows(encoded, pad, 1.0)
    assert packed.input_ids.numel() < padded.input_ids.numel()
    segments = _segments(packed)
    assert len(segments) == len(encoded) > packed.input_ids.shape[0]  # several rows share a sequence
    own, model.config._attn_implementation = model.config._attn_implementation, attention
    try:
        check_packable(model, 40)
        with torch.no_grad():
            logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids).logits
            alone = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask.long()).logits
    finally:
        model.config._attn_implementation = own
    for (r, a, b), i in zip(segments, packed.index.tolist()):
        assert packed.input_ids[r, a:b].tolist() == encoded[i].ids
        assert not packed.loss_mask[r, a]  # a row's first token is never predicted from the row before it
        assert packed.loss_mask[r, a:b].tolist() == padded.loss_mask[i, :b - a].tolist()
        torch.testing.assert_close(logits[r, a:b], alone[i, :b - a], rtol=0, atol=1e-5)
    assert not (packed.loss_mask & ~packed.attention_mask).any()  # the filler is never trained


def test_an_attention_that_mixes_packed_rows_is_refused(rows_and_model):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _, _, model = rows_and_model
    check_packable(model, 64)
    # an attention transformers builds no mask for: plain causal attention over the whole packed sequence
    AttentionInterface.register("test_causal_only", sdpa_attention_forward)
    own = model.config._attn_implementation
    model.config._attn_implementation = "test_causal_only"
    try:
        with pytest.raises(ConfigError, match="packing=true: this model's attention .*test_causal_only.* set "
                                              "packing=false"):
            check_packable(model, 64)
    finally:
        model.config._attn_implementation = own


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_neftune_noise_has_its_scale_in_training_and_none_in_eval(rows_and_model, packed):
    encoded, pad, model = rows_and_model
    batch = collate_packed(encoded, pad, 1.0, 40) if packed else collate_rows(encoded, pad, 1.0)
    emb = model.get_input_embeddings()
    clean = emb(batch.input_ids).detach()
    neft = NEFTune(model, 5.0)
    try:
        torch.manual_seed(7)  # the micro-batch's key, as common.train_pairs sets it
        neft.arm(batch)
        emb.train()
        noisy = emb(batch.input_ids).detach()
        emb.eval()
        neft.arm(batch)
        assert torch.equal(emb(batch.input_ids), clean)  # never in evaluation
        emb.train()
        torch.manual_seed(7)
        neft.arm(batch)
        assert torch.equal(emb(batch.input_ids).detach(), noisy)  # the same key draws the same noise
    finally:
        neft.handle.remove()
    d = clean.shape[-1]
    lengths = torch.tensor([len(encoded[i].ids) for i in batch.index.tolist()], dtype=torch.float64)
    scales = 5.0 / (lengths * d).sqrt()  # alpha / sqrt(L * d), L the row's own length
    delta = noisy - clean
    rows = _segments(batch) if packed else [(i, 0, len(e.ids)) for i, e in enumerate(encoded)]
    for (r, a, b), s in zip(rows, scales.tolist()):
        part = delta[r, a:b]
        assert float(part.abs().max()) <= s * (1 + 1e-5) and float(part.abs().max()) > 0.9 * s
    unit = torch.cat([delta[r, a:b].flatten() / s for (r, a, b), s in zip(rows, scales.tolist())])
    assert float(unit.pow(2).mean()) == pytest.approx(1 / 3, rel=0.05)  # uniform in [-1, 1]: E[u^2] = 1/3
    assert float(unit.mean()).__abs__() < 0.05
    assert not delta[~batch.attention_mask].any()  # padding and filler get none
