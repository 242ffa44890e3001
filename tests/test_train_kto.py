"""`alignrl train kto`: the loss worked by hand (both labels, weights, z0 clamped, the mismatched pairing), the two
row layouts, gradient accumulation against one big batch, a run that separates desirable from undesirable rows on
held-out data, exact resume, LoRA's merged folder, and mistakes as one line."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from alignrl.config import ConfigError
from alignrl.core.kto import kto_loss, weight_balance
from alignrl.data.kto_rows import KTOKeys, collate_rows, encode_rows, load_rows, shifted
from alignrl.data.loaders import DataError
from alignrl.preference.run_log import totals_per_count
from alignrl.preference.kto_cli import kto_main, parse_kto


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_a_step_logs_each_kinds_mean_over_its_rows_not_over_micro_batches():
    """Two micro-batches, one with no desirable row: the logged desirable reward is the one row's, not halved."""
    good = torch.tensor([True, False]), torch.tensor([False, False])
    parts = [kto_loss(torch.tensor(p), torch.zeros(2), g, beta=1.0, kl=0.0)[1]
             for p, g in zip(([2.0, -1.0], [-3.0, -1.0]), good)]
    mean = {k: (parts[0][k] + parts[1][k]) / 2 for k in parts[0]}  # as the step and the ranks average them
    m = totals_per_count(mean)
    assert m["rewards/chosen"] == pytest.approx(2.0) and m["rewards/rejected"] == pytest.approx(-5.0 / 3)
    assert "rewards/chosen_sum" not in m and "rewards/rejected_count" not in m


def test_kto_loss_by_hand_both_labels_weights_and_global_rows():
    pol, ref = torch.tensor([-1.0, -3.0, -2.0]), torch.tensor([-2.0, -2.0, -2.0])  # logratios 1, -1, 0
    good = torch.tensor([True, False, False])
    loss, m = kto_loss(pol, ref, good, beta=0.5, kl=0.4, desirable_weight=2.0, undesirable_weight=0.5,
                       global_rows=6)
    rows = [2.0 * (1 - _sig(0.5 * (1 - 0.4))), 0.5 * (1 - _sig(0.5 * (0.4 + 1))), 0.5 * (1 - _sig(0.5 * 0.4))]
    assert loss.item() == pytest.approx(sum(rows) / 6, abs=1e-6)
    assert m["kto/loss"] == pytest.approx(sum(rows) / 3, abs=1e-6)
    m = totals_per_count(m)  # each kind's mean over its rows, however the micro-batches split them
    assert (m["rewards/chosen"], m["rewards/rejected"], m["kl"]) == pytest.approx((0.5, -0.25, 0.4), abs=1e-6)
    # a negative KL estimate is clamped at 0: the reference point never rewards a row for the policy's drift down
    clamped, m0 = kto_loss(pol, ref, good, beta=0.5, kl=-3.0)
    unclamped, _ = kto_loss(pol, ref, good, beta=0.5, kl=0.0)
    assert m0["kl"] == 0.0 and clamped.item() == pytest.approx(unclamped.item(), abs=1e-7)
    # split invariance given the same z0: the halves' losses add up to the whole batch's
    a, _ = kto_loss(pol[:1], ref[:1], good[:1], 0.5, 0.4, 2.0, 0.5, global_rows=3)
    b, _ = kto_loss(pol[1:], ref[1:], good[1:], 0.5, 0.4, 2.0, 0.5, global_rows=3)
    whole, _ = kto_loss(pol, ref, good, 0.5, 0.4, 2.0, 0.5, global_rows=3)
    assert (a + b).item() == pytest.approx(whole.item(), abs=1e-7)


def test_kto_gradient_raises_desirable_and_lowers_undesirable_and_z0_gets_none():
    pol = torch.tensor([-2.0, -2.0], requires_grad=True)
    kl = torch.tensor(0.3, requires_grad=True)
    loss, _ = kto_loss(pol, torch.tensor([-2.0, -2.0]), torch.tensor([True, False]), beta=0.1, kl=kl)
    loss.backward()
    assert pol.grad[0] < 0 < pol.grad[1] and kl.grad is None  # descent raises log π of the desirable row
    # at logratio 0: d/dx (1 - σ(β(x - z0))) = -β σ(1 - σ), over the 2 rows
    s = _sig(0.1 * -0.3)
    assert pol.grad[0].item() == pytest.approx(-0.1 * s * (1 - s) / 2, abs=1e-7)


def test_apo_zero_unpaired_by_hand_and_weight_balance():
    loss, m = kto_loss(torch.tensor([0.0, 0.0]), torch.tensor([-1.0, 1.0]), torch.tensor([True, False]), beta=1.0,
                       kl=5.0, loss_type="apo_zero_unpaired")
    assert loss.item() == pytest.approx(((1 - _sig(1.0)) + _sig(-1.0)) / 2, abs=1e-6) and m["kl"] == 0.0
    assert weight_balance(4, 3, 1.0, 1.0) == pytest.approx(4 / 3) and weight_balance(3, 0, 1.0, 1.0) is None


GOOD, BAD = "glad to help", "go away"


def test_mismatched_pairing_is_the_next_rows_completion(tiny_model_dir, tmp_path):
    from alignrl.models.loader import load_tokenizer

    tok = load_tokenizer(tiny_model_dir, chat=False)
    three = [{"prompt": f"p{i}", "completion": word, "label": i == 1} for i, word in enumerate(["one", "two", "three"])]
    rows = load_rows(_write(tmp_path / "d.jsonl", three), KTOKeys())
    enc, cut = encode_rows(tok, rows, True, 64)
    batch = collate_rows(enc, tok.pad_token_id, 3, shifted([e.completion for e in enc]), max_length=64)
    assert cut == 0 and batch.has_kl and batch.prompt_ids.shape[0] == 6
    for i in range(3):  # row 3 + i: prompt i with completion i + 1 (the last with the first's)
        assert torch.equal(batch.prompt_ids[3 + i], batch.prompt_ids[i])
        assert torch.equal(batch.response_ids[3 + i], batch.response_ids[(i + 1) % 3])
    # with the chat template the completion is the assistant's turn, closed as the template closes one
    assert tok.decode(enc[0].completion) == "one<|im_end|>\n" and [e.desirable for e in enc] == [0, 1, 0]


def test_mismatched_rows_of_openrlhfs_text_are_the_joined_text_tokenized_anew(tiny_model_dir, tmp_path):
    """With input_template, OpenRLHF's KL row is prompt i's text with completion i + 1's tokenized whole: where the
    template's last space merges with a completion's first letter, joining ids would keep row i's own letter."""
    from alignrl.data.kto_rows import mismatched
    from alignrl.data.sft_rows import openrlhf_text
    from alignrl.models.loader import load_tokenizer

    tok = load_tokenizer(tiny_model_dir, chat=False)
    template = "User: {}\nAssistant: "
    two = [{"prompt": "Hello", "completion": "Hi there", "label": True},
           {"prompt": "Bye", "completion": "Sure", "label": False}]
    enc, _ = encode_rows(tok, load_rows(_write(tmp_path / "d.jsonl", two), KTOKeys()), False, 64, template)
    prompts, completions = mismatched(enc, tok)
    ids, head = openrlhf_text(tok, template.format("Hello"), "Sure")
    assert (prompts[0], completions[0]) == (ids[:head], ids[head:])
    assert prompts[0] + completions[0] != enc[0].prompt + enc[1].completion  # the merge: joined ids would differ
    plain, _ = encode_rows(tok, load_rows(_write(tmp_path / "d.jsonl", two), KTOKeys()), False, 64)
    assert mismatched(plain, tok) == ([e.prompt for e in plain], [plain[1].completion, plain[0].completion])


# every prompt with a desirable and an undesirable completion, interleaved so that a micro-batch holds both kinds
ROWS = [{"prompt": f"question {i}", "completion": GOOD if k else BAD, "label": bool(k)}
        for i in range(8) for k in (1, 0)]


def _write(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _run(model: Path, tmp: Path, name: str, *extra: str) -> dict:
    data = _write(tmp / "train.jsonl", ROWS)
    rc = kto_main([f"model_path={model}", f"train_files=[{data}]", "--output_dir", str(tmp / name), "--logging_dir",
                   str(tmp / f"logs_{name}"), "report_to=[jsonl]", "log_every=1", *extra])
    assert rc == 0
    return json.loads((tmp / name / "eval_results.json").read_text())


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_training_separates_desirable_from_undesirable_on_held_out_rows(tiny_model_dir, tmp_path):
    paired = _write(tmp_path / "eval.jsonl", [{"prompt": f"question {i}", "chosen": GOOD, "rejected": BAD}
                                              for i in range(8)])
    res = _run(tiny_model_dir, tmp_path, "kto", f"eval_files=[{paired}]", "batch_size=8", "epochs=4",
               "learning_rate=1e-2", "warmup_ratio=0", "beta=0.1")
    before, after = res["before"], res["after"]
    assert res["steps"] == 8 and after["rows"] == 16 and after["desirable_rows"] == 8
    # the policy starts as its reference (exactly on the CPU in fp32; approx for bf16 autocast on a GPU)
    assert before["reward_margin"] == pytest.approx(0.0, abs=1e-6) and before["kl"] == pytest.approx(0.0, abs=1e-6)
    assert after["reward_margin"] > 0.05 and after["reward_accuracy"] > 0.75 and after["loss"] < before["loss"]
    rows = [json.loads(line) for line in (tmp_path / "logs_kto" / "metrics.jsonl").read_text().splitlines()]
    assert {"kto/loss", "rewards/chosen", "rewards/rejected", "kl"} <= set().union(*rows)


ONE_STEP = ["max_steps=1", "learning_rate=1e-3", "warmup_ratio=0"]


def test_the_mismatched_half_without_gradients_gives_the_loss_and_gradients_of_one_forward_with(tiny_model_dir,
                                                                                                  tmp_path):
    """The mismatched completions run under no_grad (as TRL's KTOTrainer); z0 is detached anyway, so one micro-batch's
    loss and parameter gradients equal those of the single forward with gradients whose KL half is detached after."""
    from alignrl.core.kto import kl_estimate
    from alignrl.models.loader import load_causal_lm, load_tokenizer
    from alignrl.preference.kto import Reference, _loss_fn, logps, policy_logps
    from alignrl.runtime.env import DistEnv

    tok = load_tokenizer(tiny_model_dir, chat=False)
    enc, _ = encode_rows(tok, load_rows(_write(tmp_path / "d.jsonl", ROWS[:6]), KTOKeys()), False, 64)
    batch = collate_rows(enc, tok.pad_token_id, 6, shifted([e.completion for e in enc]), max_length=64)
    cfg = parse_kto([f"model_path={tiny_model_dir}", "train_files=[d.jsonl]", "beta=0.5", "bf16=false"])
    policy, env = load_causal_lm(str(tiny_model_dir), "float32", "model_path"), DistEnv()
    ref = Reference(cfg, policy, env, False, None)
    torch.manual_seed(0)
    with torch.no_grad():  # the policy moves off its reference, so that z0 and the rewards are not all 0
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    policy.eval()  # no dropout: both ways see the same network

    def grads(loss: torch.Tensor) -> list[torch.Tensor]:
        policy.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in policy.parameters()]

    loss, m = _loss_fn(cfg, env, ref)(policy, batch, 6.0)
    new = grads(loss)
    own, kl = logps(policy, batch)  # one forward with gradients over both halves, z0 detached after
    ref_own, ref_kl = ref(batch)
    old_loss, old_m = kto_loss(own, ref_own, batch.desirable, 0.5, float(kl_estimate(kl, ref_kl)), global_rows=6.0)
    old = grads(old_loss)
    assert kl.requires_grad and not policy_logps(policy, batch)[1].requires_grad
    assert torch.allclose(policy_logps(policy, batch)[1], kl, atol=1e-6)  # the same KL half, without its graph
    assert m["kl"] > 0 and m["kl"] == pytest.approx(old_m["kl"], abs=1e-6)
    assert loss.item() == pytest.approx(old_loss.item(), abs=1e-6)
    assert max(float((a - b).abs().max()) for a, b in zip(new, old)) < 1e-6 and any(g.abs().sum() > 0 for g in new)


@pytest.mark.parametrize("loss", ["kto", "apo_zero_unpaired"])
def test_gradient_accumulation_gives_the_update_of_one_big_batch(tiny_model_dir, tmp_path, loss):
    # kto: z0 is each micro-batch's own estimate (TRL's); on the first step the policy is its reference, so every
    # split's z0 is 0 and the updates agree. apo_zero_unpaired has no z0: two steps agree too.
    steps = ["max_steps=1"] if loss == "kto" else ["max_steps=2"]
    common = [f"loss_type={loss}", "learning_rate=1e-3", "warmup_ratio=0", *steps]
    _run(tiny_model_dir, tmp_path, "big", "batch_size=4", *common)
    _run(tiny_model_dir, tmp_path, "accum", "batch_size=2", "gradient_accumulation_steps=2", *common)
    big, accum, base = _weights(tmp_path / "big"), _weights(tmp_path / "accum"), _weights(tiny_model_dir)
    assert any(not torch.equal(big[k], base[k]) for k in base)
    for k in big:
        torch.testing.assert_close(accum[k], big[k], rtol=0, atol=1e-6)


def test_two_ddp_ranks_give_the_update_of_one_big_batch(tiny_model_dir, tmp_path):
    import os

    from conftest import run_group

    _run(tiny_model_dir, tmp_path, "big", "batch_size=4", *ONE_STEP)
    data = _write(tmp_path / "train.jsonl", ROWS)
    p = run_group([sys.executable, "-m", "alignrl", "train", "kto", "--nproc", "2", f"model_path={tiny_model_dir}",
                   f"train_files=[{data}]", "--output_dir", str(tmp_path / "ddp"), "--logging_dir",
                   str(tmp_path / "logs"), "report_to=[jsonl]", "batch_size=2", "strategy=ddp", *ONE_STEP], 120,
                  env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert json.loads((tmp_path / "ddp" / "eval_results.json").read_text())["world_size"] == 2
    ddp, big = _weights(tmp_path / "ddp"), _weights(tmp_path / "big")
    for k in big:
        torch.testing.assert_close(ddp[k], big[k], rtol=0, atol=1e-6)


def test_a_resumed_run_ends_with_the_weights_of_an_unbroken_one(tiny_model_dir, tmp_path, capsys):
    common = ["batch_size=4", "max_steps=4", "learning_rate=1e-3", "use_lora=true", "lora_rank=4", "lora_dropout=0.1",
              "undesirable_weight=1.5"]
    _run(tiny_model_dir, tmp_path, "whole", "save_steps=2", *common)
    # 8 desirable rows × 1.0 against 8 × 1.5: outside the KTO paper's [1, 4/3], said in one line with a range
    assert "= 0.667, outside the recommended [1, 4/3]; e.g. desirable_weight in [1.5, 2]" in capsys.readouterr().out
    res = _run(tiny_model_dir, tmp_path, "resumed", f"resume_from={tmp_path / 'whole.checkpoints' / 'step_2'}",
               *common)
    assert res["steps"] == 4
    whole, resumed, base = _weights(tmp_path / "whole"), _weights(tmp_path / "resumed"), _weights(tiny_model_dir)
    assert not (tmp_path / "whole" / "adapter_config.json").exists() and whole.keys() == base.keys()  # merged
    assert any(not torch.equal(whole[k], base[k]) for k in base)
    for k in whole:
        torch.testing.assert_close(resumed[k], whole[k], rtol=0, atol=1e-6)


def test_openrlhf_and_trl_flags_read_as_keys(tmp_path):
    data = _write(tmp_path / "d.jsonl", ROWS)
    cfg = parse_kto(["--pretrain", "demo", "--dataset", f"{data},{data}", "--input_key", "question", "--output_key",
                     "answer", "--label_key", "thumbs_up", "--desirable_loss_weight", "1.33", "--max_len", "64",
                     "--micro_train_batch_size", "2", "--lora_rank", "8", "--beta", "0.05", "--save_steps", "-1"])
    assert (cfg.train_files, cfg.prompt_key, cfg.completion_key, cfg.label_key) == ([data, data], "question", "answer",
                                                                                    "thumbs_up")
    assert (cfg.desirable_weight, cfg.max_length, cfg.batch_size, cfg.beta, cfg.save_steps) == (1.33, 64, 2, 0.05, 0)
    assert cfg.use_lora and cfg.lora_rank == 8
    default = parse_kto([f"train_files=[{data}]"])
    assert (default.beta, default.learning_rate, default.loss_type, default.max_length) == (0.1, 1e-6, "kto", 1024)



class _Quiet:
    def print(self, *_):
        pass


def test_an_openrlhf_line_trains_on_openrlhfs_text(tiny_model_dir, tmp_path):
    """train_kto's line without --apply_chat_template: each row's prompt + completion ids are the tokens of
    OpenRLHF's text built by hand (its default template filled, trailing newlines dropped, " " + eos unless the
    completion ends with it, no special tokens), the completion starting at the prompt's own token count; a row of
    chat messages is refused in one line, and templated with --apply_chat_template."""
    from alignrl.models.loader import load_tokenizer
    from alignrl.preference.kto import _encode, _load

    tok = load_tokenizer(tiny_model_dir, chat=False)
    eos = tok.eos_token
    rows = [{"q": "hi", "a": "Paris\n", "ok": True}, {"q": "1+1", "a": f"2{eos}", "ok": False}]
    line = ["--pretrain", str(tiny_model_dir), "--dataset", _write(tmp_path / "kto.jsonl", rows), "--input_key", "q",
            "--output_key", "a", "--label_key", "ok"]
    cfg = parse_kto(line)
    keys = KTOKeys(cfg.prompt_key, cfg.completion_key, cfg.label_key)
    enc, _, _ = _encode(tok, cfg, _load(cfg.train_files, keys, 0, "train_files"), [], _Quiet())
    theirs = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    for e, head, text in zip(enc, ("User: hi\nAssistant: ", "User: 1+1\nAssistant: "),
                             ("User: hi\nAssistant: Paris " + eos, f"User: 1+1\nAssistant: 2{eos}")):
        assert (e.prompt + e.completion, e.prompt) == (theirs(text), theirs(head))
    chat = [{"q": [{"role": "user", "content": "hi"}], "a": [{"role": "assistant", "content": "yo"}], "ok": True}]
    line[line.index("--dataset") + 1] = _write(tmp_path / "chat.jsonl", chat)
    cfg = parse_kto(line)
    rows = _load(cfg.train_files, keys, 0, "train_files")
    with pytest.raises(DataError, match=r"chat.jsonl:1: the row holds chat messages, and input_template"):
        _encode(tok, cfg, rows, [], _Quiet())
    assert _encode(tok, parse_kto([*line, "--apply_chat_template"]), rows, [], _Quiet())[0][0].completion

def test_max_pairs_caps_the_lines_of_all_files_together(tmp_path):
    """OpenRLHF's --max_samples: the first N lines of the blend, not of each file (a paired line gives two rows);
    a file past the cap is not read."""
    from alignrl.preference.kto import _load

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps({"prompt": "p", "chosen": "c0", "rejected": "r0"}) + "\n")
    b.write_text("".join(json.dumps({"prompt": "p", "completion": f"d{i}", "label": i % 2 == 0}) + "\n"
                         for i in range(5)))
    rows = _load([str(a), str(b), str(tmp_path / "never_read.jsonl")], KTOKeys(), 3, "train_files")
    assert [(r.completion, r.desirable) for r in rows] == [("c0", True), ("r0", False), ("d0", True), ("d1", False)]
    assert len(_load([str(a), str(b)], KTOKeys(), 0, "train_files")) == 7


def test_mistakes_are_one_line(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="batch_size=1"):
        parse_kto(["train_files=[x.jsonl]", "batch_size=1"])
    with pytest.raises(ConfigError, match=r"input_template='User: \{\} \{\}' must hold one \{\} where the prompt goes"):
        parse_kto(["--dataset", "x.jsonl", "--input_template", "User: {} {}"])
    bad = _write(tmp_path / "bad.jsonl", [ROWS[0], {"prompt": "q", "completion": "a", "label": "maybe"}])
    with pytest.raises(DataError, match=f"{bad}:2: label must be true or false"):
        load_rows(bad, KTOKeys())
    half = _write(tmp_path / "half.jsonl", [{"prompt": "q", "chosen": "a"}])
    with pytest.raises(DataError, match="half.jsonl:1: paired row is missing rejected"):
        load_rows(half, KTOKeys())
    p = subprocess.run([sys.executable, "-m", "alignrl", "train", "kto", f"model_path={tiny_model_dir}",
                        f"train_files=[{bad}]"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0, p.stderr
    assert p.stderr.startswith(f"alignrl: error: {bad}:2: label must be true or false")
