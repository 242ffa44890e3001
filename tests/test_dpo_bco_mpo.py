"""TRL's bco_pair (a running reward mean δ, shared by the ranks, checkpointed), multi-loss DPO (MPO: a list
loss_type with loss_weights) and IPO on token means in `alignrl train dpo`: the weighted sum against its parts, a
one-loss list against the loss alone, δ averaged over ranks, a resumed run that ends where the unbroken one does,
ipo_token_mean against IPO on hand-made token means, and mistakes as one line."""

import json
from pathlib import Path

import pytest
import torch

from alignrl.core.preference import DPO_LOSSES, sft_loss
from alignrl.preference import dpo_mix
from alignrl.preference.cli import dpo_main, parse_dpo
from alignrl.runtime.env import DistEnv

TINY = ["max_train_pairs=8", "max_eval_pairs=4", "batch_size=4", "eval_batch_size=8", "learning_rate=1e-2",
        "warmup_ratio=0", "log_every=1", "report_to=[jsonl]", "bf16=false", "strategy=single"]


class _Batch:  # what mixed_loss reads of a preference batch: the response mask (token means) and the pair count
    def __init__(self, n: int, lengths: list[int]):
        self.n_pairs = n
        self.response_mask = torch.tensor([[1] * k + [0] * (4 - k) for k in lengths])


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, generator=g) * 2 for _ in range(4)] + [torch.rand(4, generator=g)]


def test_a_list_is_the_weighted_sum_of_its_losses_and_a_one_loss_list_is_that_loss():
    pc, pr, rc, rr, nll = _inputs()
    batch = _Batch(4, [1, 2, 3, 4, 4, 3, 2, 1])
    cfg = parse_dpo(["loss_type=[sigmoid,bco_pair,sft]", "loss_weights=[0.8,0.2,1.0]", "beta=0.3"])
    bco = dpo_mix.BcoDelta(DistEnv())
    loss, m = dpo_mix.mixed_loss(cfg, pc, pr, rc, rr, nll, batch, 8.0, bco)
    delta = float(torch.cat([0.3 * (pc - rc), 0.3 * (pr - rr)]).mean())  # the first micro-batch sets δ
    parts = [DPO_LOSSES["sigmoid"](pc, pr, rc, rr, 0.3, 8.0)[0], DPO_LOSSES["bco_pair"](pc, pr, rc, rr, 0.3, 8.0,
                                                                                        bco_delta=delta)[0],
             sft_loss(pc, pr, rc, rr, 0.3, 8.0, nll=nll)[0]]
    assert loss.item() == pytest.approx((0.8 * parts[0] + 0.2 * parts[1] + parts[2]).item(), rel=1e-6)
    for name, part in zip(("sigmoid", "bco_pair", "sft"), parts):  # each loss's own per-pair mean
        assert m[f"loss/{name}"] == pytest.approx(part.item() * 8.0 / 4, rel=1e-6)
    assert m["bco/delta"] == pytest.approx(delta) and "rewards/accuracy" in m and "dpo/loss" not in m
    # simpo in a list reads token means, as it does alone
    free = parse_dpo(["loss_type=[simpo]", "beta=2.0"])
    zero = torch.zeros(4)
    alone = DPO_LOSSES["simpo"](pc / torch.tensor([1, 2, 3, 4.]), pr / torch.tensor([4, 3, 2, 1.]), zero, zero, 2.0,
                                8.0, simpo_gamma=0.5)[0]
    assert torch.equal(dpo_mix.mixed_loss(free, pc, pr, zero, zero, nll, batch, 8.0, None, simpo_gamma=0.5)[0], alone)
    one = parse_dpo(["loss_type=[sigmoid]", "beta=0.3"])
    assert torch.equal(dpo_mix.mixed_loss(one, pc, pr, rc, rr, nll, batch, 8.0, None)[0],
                       DPO_LOSSES["sigmoid"](pc, pr, rc, rr, 0.3, 8.0)[0])


def test_delta_is_the_running_mean_of_the_ranks_mean_rewards(monkeypatch):
    """TRL gathers one mean reward per rank and each update counts the world size: with another rank whose mean is
    known, δ is the mean of the two ranks' means, then the running mean of such."""
    import alignrl.runtime.env as env_mod

    other = iter([1.0, -2.0])
    monkeypatch.setattr(env_mod, "all_reduce_sum", lambda env, values: [values[0] + next(other)])
    bco = dpo_mix.BcoDelta(DistEnv(rank=0, world_size=2))
    pc, pr, zero = torch.tensor([2.0, 0.0]), torch.tensor([0.0, -2.0]), torch.zeros(2)  # β = 1: mean reward 0
    assert bco.update(pc, pr, zero, zero, 1.0) == pytest.approx(0.5)  # (0 + 1) / 2
    assert bco.update(pc + 4, pr + 4, zero, zero, 1.0) == pytest.approx((0.5 + (4.0 - 2.0) / 2) / 2)
    assert bco.state_dict()["count"] == pytest.approx(4.0)


def _argv(model: Path, tmp: Path, name: str, loss: str, *extra: str) -> list[str]:
    return [f"model_path={model}", "--output_dir", str(tmp / name), "--logging_dir", str(tmp / f"logs_{name}"),
            f"loss_type={loss}", *TINY, *extra]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("loss, extra", [("bco_pair", []), ("[sigmoid,bco_pair,sft]", ["loss_weights=[0.8,0.2,1.0]"])],
                         ids=["bco_pair", "mpo"])
def test_a_resumed_run_ends_where_the_whole_run_does_with_the_saved_delta(loss, extra, tiny_model_dir, tmp_path,
                                                                          capsys):
    assert dpo_main(_argv(tiny_model_dir, tmp_path, "whole", loss, "save_steps=2", *extra)) == 0
    ckpt = tmp_path / "whole.checkpoints" / "step_2"
    saved = json.loads((ckpt / "state.json").read_text())["bco_pair"]
    assert saved["count"] == pytest.approx(2.0) and saved["mean"] != 0.0  # two micro-batches, one rank
    # δ restarted at 0 would train steps 3 and 4 against another shift: a checkpoint without it is refused
    plain = tmp_path / "plain_ckpt"
    plain.mkdir()
    for f in ckpt.iterdir():
        (plain / f.name).write_bytes(f.read_bytes())
    (plain / "state.json").write_text(json.dumps({"step": 2}))
    assert dpo_main(_argv(tiny_model_dir, tmp_path, "refused", loss, f"resume_from={plain}", *extra)) == 2
    assert "holds no running reward mean of bco_pair" in capsys.readouterr().err
    assert dpo_main(_argv(tiny_model_dir, tmp_path, "resumed", loss, f"resume_from={ckpt}", *extra)) == 0
    whole, resumed = _weights(tmp_path / "whole"), _weights(tmp_path / "resumed")
    for k in whole:
        torch.testing.assert_close(resumed[k], whole[k], rtol=0, atol=1e-6)
    # the same checkpoint with δ reset to 0 ends elsewhere: the saved δ is what made the two equal
    (plain / "state.json").write_text(json.dumps({"step": 2, "bco_pair": {"mean": 0.0, "count": 1e-24}}))
    assert dpo_main(_argv(tiny_model_dir, tmp_path, "reset", loss, f"resume_from={plain}", *extra)) == 0
    reset = _weights(tmp_path / "reset")
    assert max(float((reset[k] - whole[k]).abs().max()) for k in whole) > 1e-5
    rows = [json.loads(line) for line in (tmp_path / "logs_whole" / "metrics.jsonl").read_text().splitlines()]
    keys = set().union(*rows)
    assert "bco/delta" in keys and ("loss/sft" in keys) == (loss != "bco_pair")


@pytest.mark.parametrize("argv, expect", [
    (["loss_type=[sigmoid,nope]"], "unknown loss 'nope'"),
    (["loss_type=[sigmoid,sft]", "loss_weights=[1.0]"], "loss_weights=[1.0] must be 2 finite numbers"),
    (["loss_type=[sigmoid,simpo]"], "mixes simpo (no reference model) with sigmoid"),
    (["loss_type=[orpo,sft]"], "orpo is not combined with other losses"),
    (["loss_type=[safe_mm_dpo,sft]"], "safe_mm_dpo is not combined with other losses"),
    (["loss_type=[sigmoid,sigmoid]"], "a loss named twice"),
    (["loss_type=[sft]"], "sft alone is no preference loss"),
    (["loss_type=sigmoid", "loss_weights=[0.5]"], "loss_weights=[0.5] weighs the losses of a list loss_type"),
    (["loss_type=[simpo,sft]", "kl_coeff=0.1"], "uses no reference model, so kl_coeff=0.1"),
    (["loss_type=[robust,sft]", "label_smoothing=0.5"], "robust needs label_smoothing below 0.5"),
])
def test_list_mistakes_are_one_line(argv, expect, capsys):
    assert dpo_main(argv) == 2
    err = capsys.readouterr().err
    assert expect in err and err.count("\n") == 1 and "Traceback" not in err


def test_ipo_token_mean_is_ipo_on_the_token_means_of_policy_and_reference(tiny_model_dir):
    """TRL's ipo divides every log-prob, the reference's too, by its response's length; alignrl's ipo keeps sums."""
    from alignrl.core.preference import dpo_ipo_loss
    from alignrl.data.preference import collate_pairs, encode_pairs, load_pairs
    from alignrl.models.loader import load_model
    from alignrl.preference.dpo import _loss_fn, _Reference
    from alignrl.preference.pair_logps import pair_logps

    policy, tok = load_model(str(tiny_model_dir))
    pairs = load_pairs("builtin:helpful", "better", limit=4)
    batch = collate_pairs(encode_pairs(tok, pairs, 128)[0], pairs, tok.pad_token_id)
    cfg = parse_dpo([f"model_path={tiny_model_dir}", "loss_type=ipo_token_mean", "beta=0.1", "bf16=false"])
    env = DistEnv()
    ref = _Reference(cfg, policy, env, False)
    torch.manual_seed(0)
    with torch.no_grad():  # off the reference, so that the log-ratios are not all 0
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    policy.eval()
    loss, _ = _loss_fn(cfg, env, ref, None, None)(policy, batch, 4.0)
    with torch.no_grad():
        pc, pr, _ = pair_logps(policy, batch)
        rc, rr, _ = pair_logps(ref.model, batch)
    n = batch.response_mask.sum(-1).float()
    assert len(set(n.tolist())) > 1  # responses of several lengths: means and sums disagree
    by_hand = dpo_ipo_loss(pc / n[:4], pr / n[4:], rc / n[:4], rr / n[4:], 0.1, 4.0)[0]
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-5)
    assert abs(dpo_ipo_loss(pc, pr, rc, rr, 0.1, 4.0)[0].item() - by_hand.item()) > 1e-3
