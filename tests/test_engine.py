"""The embedded rollout engine against `model.generate`, and its sampling controls."""

import torch

from alignrl.data import synthetic
from alignrl.data.collate import encode_prompts, left_pad
from alignrl.models.logprobs import response_logprobs
from alignrl.rollout.hf_engine import HFRolloutEngine, SamplingParams, _filter_logits


def _prompts(tok, n=6):
    return encode_prompts(tok, synthetic.generate("test", n, seed=3), 128)


def test_greedy_matches_hf_generate(tiny_model):
    model, tok = tiny_model
    prompts = _prompts(tok)
    ro = HFRolloutEngine(model, tok).generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
    ids, mask = left_pad(prompts, tok.pad_token_id)
    with torch.inference_mode():
        ref = model.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=12, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    for i in range(len(prompts)):
        n = int(ro.response_mask[i].sum())
        assert ro.response_ids[i, :n].tolist() == ref[i, :n].tolist()


def test_records_shapes_groups_and_logprobs(tiny_model):
    model, tok = tiny_model
    ro = HFRolloutEngine(model, tok).generate(_prompts(tok, 3), SamplingParams(n=4, max_new_tokens=10, seed=1))
    b = 12
    assert ro.prompt_ids.shape[0] == b and ro.response_ids.shape == ro.logprobs.shape == ro.response_mask.shape
    assert ro.group.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    # rows that stopped early end with eos; truncated rows used all 10 tokens
    lengths = ro.response_mask.sum(1)
    assert torch.equal(ro.truncated, lengths == 10)
    for i in range(b):
        if not ro.truncated[i]:
            assert ro.response_ids[i, lengths[i] - 1] == tok.eos_token_id
    # the engine's log-probs equal the trainer's recomputation (same model, fp32)
    lp, _ = response_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
    torch.testing.assert_close(lp, ro.logprobs, atol=1e-4, rtol=0)


def test_seeded_sampling_is_reproducible(tiny_model):
    model, tok = tiny_model
    eng, prompts = HFRolloutEngine(model, tok), _prompts(tok, 2)
    a = eng.generate(prompts, SamplingParams(n=3, max_new_tokens=8, seed=7))
    b = eng.generate(prompts, SamplingParams(n=3, max_new_tokens=8, seed=7))
    c = eng.generate(prompts, SamplingParams(n=3, max_new_tokens=8, seed=8))
    assert torch.equal(a.response_ids, b.response_ids) and not torch.equal(a.response_ids, c.response_ids)


def test_stop_strings_end_generation(tiny_model):
    model, tok = tiny_model
    eng, prompts = HFRolloutEngine(model, tok), _prompts(tok, 4)
    free = eng.generate(prompts, SamplingParams(n=2, max_new_tokens=16, seed=0))
    texts = tok.batch_decode(free.response_ids.masked_fill(~free.response_mask, tok.pad_token_id))
    # pick a character that the free run produced mid-response, then stop on it
    stop = next(ch for t in texts for ch in t[:-1] if ch.strip())
    ro = eng.generate(prompts, SamplingParams(n=2, max_new_tokens=16, seed=0, stop=(stop,)))
    for i, t in enumerate(tok.batch_decode(ro.response_ids.masked_fill(~ro.response_mask, tok.pad_token_id))):
        if stop in t:
            assert not ro.truncated[i]
            # nothing was generated after the token that completed the stop string
            last = tok.decode(ro.response_ids[i, : int(ro.response_mask[i].sum()) - 1])
            assert stop not in last


def test_top_k_and_top_p_filtering():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    k2 = _filter_logits(logits, top_k=2, top_p=1.0)
    assert torch.isinf(k2[0, 2:]).all() and torch.isfinite(k2[0, :2]).all()
    # softmax = 0.644, 0.237, 0.087, 0.032: top_p=0.7 keeps the first two (0.644 < 0.7)
    p = _filter_logits(logits, top_k=-1, top_p=0.7)
    assert torch.isfinite(p[0, :2]).all() and torch.isinf(p[0, 2:]).all()
    eng_params = SamplingParams(temperature=1.0, top_k=1)
    from alignrl.rollout.hf_engine import sample_next

    tok, _ = sample_next(torch.randn(5, 4), eng_params, torch.Generator().manual_seed(0))
    assert tok.shape == (5,)


def test_fast_decoder_matches_the_generic_path(tiny_model, monkeypatch):
    """The static-cache decoder and plain `model(...)` decoding give the same tokens and log-probs, with
    prompts of different lengths, several samples per prompt and rows finishing at different steps."""
    import alignrl.rollout.hf_engine as hf

    model, tok = tiny_model
    eng = HFRolloutEngine(model, tok)
    prompts = _prompts(tok, 5)
    assert len({len(p) for p in prompts}) > 1
    fast_greedy = eng.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=14))
    fast = eng.generate(prompts, SamplingParams(n=3, max_new_tokens=14, seed=4))
    monkeypatch.setattr(hf.KVDecoder, "supports", staticmethod(lambda model: False))
    slow_greedy = eng.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=14))
    slow = eng.generate(prompts, SamplingParams(n=3, max_new_tokens=14, seed=4))
    for a, b in ((fast_greedy, slow_greedy), (fast, slow)):
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    assert not bool(fast.truncated.all()) and bool(fast.response_mask[:, -1].any())  # early and late finishers


def test_greedy_with_repeated_prompts_matches_hf_generate(tiny_model):
    """Each prompt is prefilled once and its n greedy samples share one decoder row: they decode exactly as generate's
    n copies."""
    model, tok = tiny_model
    prompts = _prompts(tok, 4)
    ro = HFRolloutEngine(model, tok).generate(prompts, SamplingParams(n=3, temperature=0.0, max_new_tokens=16))
    ids, mask = left_pad([p for p in prompts for _ in range(3)], tok.pad_token_id)
    with torch.inference_mode():
        ref = model.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=16, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    for i in range(len(ro.response_ids)):
        n = int(ro.response_mask[i].sum())
        assert ro.response_ids[i, :n].tolist() == ref[i, :n].tolist()


def test_inverse_cdf_sampling_follows_the_distribution():
    from alignrl.rollout.hf_engine import _inverse_cdf

    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0]).expand(20000, 5)
    draws = _inverse_cdf(probs, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=5).float() / len(draws)
    assert freq[1] == 0 and freq[4] == 0  # zero-probability tokens are never drawn
    # 20000 draws: the standard error of a frequency near 0.5 is 0.0035; 0.015 is > 4 of them
    torch.testing.assert_close(freq, probs[0], atol=0.015, rtol=0)


def test_a_stop_string_split_over_byte_tokens_is_seen_and_a_tiny_temperature_is_greedy(tiny_model):
    """A stop string of multi-byte characters spans more tokens than it has characters (byte-level BPE); a
    temperature near zero samples the argmax with finite log-probs instead of overflowing logits / T."""
    from alignrl.rollout.hf_engine import sample_next

    model, tok = tiny_model
    engine = HFRolloutEngine(model, tok)
    ids = tok.encode("1+1=你好", add_special_tokens=False)
    assert len(ids) > len("你好") + 2  # more tokens than the old window of characters + 2
    out = torch.tensor([ids])
    assert engine._hit_stop(torch.tensor([0]), out, len(ids) - 1, ("你好",)).tolist() == [True]
    logits = torch.randn(4, 50)
    tok_ids, lp = sample_next(logits, SamplingParams(temperature=1e-40), None)
    assert torch.equal(tok_ids, logits.argmax(-1)) and torch.isfinite(lp).all()


class _IdsOnly:
    eos_token_id, pad_token_id = 1, 0


def _llama(**extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                         **extra)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model


def test_the_fast_decoder_keeps_the_mlp_and_attention_biases():
    """Llama with mlp_bias (and attention_bias): the fused gate/up projection dropped the MLP biases, so every
    token after the first came from another model."""
    from alignrl.rollout.decoder import KVDecoder

    for extra in ({"mlp_bias": True}, {"mlp_bias": True, "attention_bias": True}):
        model = _llama(**extra)
        assert KVDecoder.supports(model)
        prompts = [torch.randint(2, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 11)]
        ro = HFRolloutEngine(model, _IdsOnly(), [1]).generate(prompts, SamplingParams(temperature=0.0,
                                                                                      max_new_tokens=12))
        for i, p in enumerate(prompts):
            ids = torch.tensor([p])
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                                 eos_token_id=1, pad_token_id=0)[0, len(p):]
            got = ro.response_ids[i][ro.response_mask[i]].tolist()
            assert got == ref.tolist()[:len(got)], extra
        lp, _ = response_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
        torch.testing.assert_close(lp, ro.logprobs, atol=1e-5, rtol=0)


def test_a_response_ends_at_any_eos_of_the_generation_config():
    """Qwen2.5-Instruct and Llama 3 list more EOS tokens in generation_config than the tokenizer's one; the
    training engines stopped at the tokenizer's alone and ran on past a real end."""
    model = _llama()
    prompt = [5, 6, 7]
    first = int(HFRolloutEngine(model, _IdsOnly(), [1]).generate(
        [prompt], SamplingParams(temperature=0.0, max_new_tokens=4)).response_ids[0, 0])
    model.generation_config.eos_token_id = [1, first]  # the greedy first token is an EOS too
    ro = HFRolloutEngine(model, _IdsOnly()).generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert ro.response_ids[0][ro.response_mask[0]].tolist() == [first] and not bool(ro.truncated[0])


def test_degenerate_requests_are_one_line_errors(tiny_model):
    """An empty prompt was sampled from the pad token, max_new_tokens=0 gave a rollout the trainer crashed on,
    and no prompts at all was a bare error from the padding."""
    import pytest

    model, tok = tiny_model
    eng = HFRolloutEngine(model, tok)
    ok = _prompts(tok, 1)[0]
    for prompts, params, said in (([ok, []], SamplingParams(max_new_tokens=4), "prompt 1 is empty"),
                                  ([ok], SamplingParams(max_new_tokens=0), "max_new_tokens must be at least 1"),
                                  ([], SamplingParams(max_new_tokens=4), "no prompts")):
        with pytest.raises(ValueError, match=said):
            eng.generate(prompts, params)


def test_decode_attention_equals_sdpa_with_grouped_heads_and_left_padding():
    from alignrl.rollout.decoder import _decode_attention

    torch.manual_seed(0)
    n, heads, kv, dim, keys = 6, 4, 2, 8, 11
    q, k, v = torch.randn(n, heads, 1, dim), torch.randn(n, kv, keys, dim), torch.randn(n, kv, keys, dim)
    mask = torch.ones(n, 1, 1, keys, dtype=torch.bool)
    mask[0, ..., :3] = False  # a left-padded prompt
    mask[4, ..., :1] = False
    bias = torch.zeros(n, 1, 1, keys).masked_fill(~mask, float("-inf"))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    got = _decode_attention(q, k, v, bias, 0.3).reshape(n, heads, 1, dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _rows_per_step(monkeypatch):
    """The rows the fast decoder computes at each of its steps, recorded."""
    import alignrl.rollout.hf_engine as hf

    rows, step = [], hf.KVDecoder.step
    monkeypatch.setattr(hf.KVDecoder, "step", lambda self, tokens: rows.append(len(tokens)) or step(self, tokens))
    return rows


def test_samples_share_a_decoder_row_until_their_draws_differ(tiny_model, monkeypatch):
    """Samples of one prompt that drew the same tokens so far have the same cache and next-token logits: the decoder
    computes each such state once, splits it when the draws differ and drops it when its samples finished (at once
    on a split, else once dead states are an eighth of its rows). The samples stay what the model gives them: their
    log-probs equal the trainer's recomputation; greedy samples never split. (The test model is untrained, so its
    samples share prefixes at a low temperature only: at 0.05 its 32 samples are 6 states at the first step, 21 at
    the 13th.)"""
    model, tok = tiny_model
    prompts = _prompts(tok, 4)
    rows = _rows_per_step(monkeypatch)
    ro = HFRolloutEngine(model, tok).generate(prompts, SamplingParams(n=8, temperature=0.05, max_new_tokens=14,
                                                                      seed=5))
    lengths = ro.response_mask.sum(1)
    for j, decoded in enumerate(rows, start=1):  # decode step j computes the logits of token j
        going = lengths > j
        states = len({(int(g), tuple(r[:j].tolist())) for g, r in zip(ro.group[going], ro.response_ids[going])})
        assert states <= decoded and (decoded - states) * 8 < decoded, (j, states, decoded)
    assert sum(rows) < 0.5 * sum(int((lengths > j).sum()) for j in range(1, len(rows) + 1))  # shared, not per sample
    lp, _ = response_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, 0.05)
    torch.testing.assert_close(lp, ro.logprobs, atol=1e-3, rtol=0)
    rows.clear()
    greedy = HFRolloutEngine(model, tok).generate(prompts, SamplingParams(n=3, temperature=0.0, max_new_tokens=14))
    assert rows and max(rows) <= len(prompts)
    assert torch.equal(greedy.response_ids[0::3], greedy.response_ids[1::3])
