"""min_p and the repetition penalty: vLLM's and HF's sampling controls (TRL's --min_p, --repetition_penalty) in
the embedded engine, the generation server and the config."""

import math

import torch

from alignrl.data import synthetic
from alignrl.data.collate import encode_prompts
from alignrl.rollout.hf_engine import HFRolloutEngine, SamplingParams, _filter_logits, repetition_penalized


def test_min_p_keeps_the_tokens_within_its_share_of_the_likeliest():
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = _filter_logits(logp, top_k=-1, top_p=1.0, min_p=0.5).isfinite()  # p >= 0.25 stays
    assert kept.tolist() == [[True, True, False, False]]
    assert _filter_logits(logp, -1, 1.0, 0.0).isfinite().all()


def test_the_repetition_penalty_divides_positive_logits_and_multiplies_negative_ones_of_seen_tokens():
    logits = torch.tensor([[2.0, -1.0, 3.0]])
    seen = torch.tensor([[True, True, False]])
    assert repetition_penalized(logits, seen, 2.0).tolist() == [[1.0, -2.0, 3.0]]


def test_greedy_with_a_repetition_penalty_matches_hf_generate(tiny_model):
    model, tok = tiny_model
    prompt = encode_prompts(tok, synthetic.generate("test", 1, seed=5), 128)
    ro = HFRolloutEngine(model, tok).generate(prompt * 2, SamplingParams(temperature=0.0, max_new_tokens=12,
                                                                        repetition_penalty=1.8))
    plain = HFRolloutEngine(model, tok).generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=12))
    ids = torch.tensor(prompt)
    with torch.inference_mode():  # one unpadded prompt: HF penalizes the prompt's tokens and the response's
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             repetition_penalty=1.8, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
    n = int(ro.response_mask[0].sum())
    assert ro.response_ids[0, :n].tolist() == ref[:n].tolist() == ro.response_ids[1, :n].tolist()
    assert ro.response_ids[0].tolist() != plain.response_ids[0].tolist()  # the penalty changed what was drawn


def test_min_p_of_one_samples_the_likeliest_token_and_trl_flags_reach_the_config(tiny_model, tmp_path):
    import json

    from alignrl.compat.trl_grpo_keys import from_line
    from alignrl.config import load_config

    model, tok = tiny_model
    prompts = encode_prompts(tok, synthetic.generate("test", 2, seed=5), 128)
    eng = HFRolloutEngine(model, tok)
    greedy = eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))
    sampled = eng.generate(prompts, SamplingParams(n=2, temperature=1.0, min_p=1.0, max_new_tokens=8, seed=3))
    assert torch.equal(sampled.response_ids[::2, :greedy.response_ids.shape[1]], greedy.response_ids)
    assert all(math.isfinite(v) for v in sampled.logprobs.flatten().tolist())
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1+1?", "solution": "2"}) + "\n")
    words, _ = from_line(["--model_name_or_path", "demo", "--dataset_name", str(data), "--reward_funcs",
                          "accuracy_reward", "--min_p", "0.05", "--repetition_penalty", "1.1"])
    cfg = load_config(None, [w for w in words if "=" in w])
    assert (cfg.rollout.min_p, cfg.rollout.repetition_penalty) == (0.05, 1.1)
