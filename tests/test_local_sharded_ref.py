"""The RL loop's frozen reference under torchrun beside an FSDP2 policy: sharded over the trainer's two gloo ranks
(each holding half of it) instead of a whole copy on each (DDP's replicas), and the run trains exactly as with the
whole copy, also with the reference moved toward the policy after every update (actor.ref_sync_steps): each rank
mixes its own rows and a checkpoint holds the whole moved reference (a resume reading each rank's rows of a moved
reference: test_distributed_loop's DDP run resumed on FSDP2)."""

import json
import re

import pytest

from test_distributed_loop import run, weights

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# the reference moved halfway toward the policy after every update; every step is checkpointed
KL = ("actor.use_kl_loss=true", "actor.kl_loss_coef=0.1", "actor.ref_sync_steps=1", "actor.ref_mixup_alpha=0.5",
      "trainer.save_freq=1", "trainer.max_checkpoints=0")
LINE = r"reference: {} ([\d.]+) MiB"


def _kl(run_dir) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    return [x["actor/kl_loss"] for x in rows if "actor/kl_loss" in x]


def _assert_same(mine: dict, theirs: dict, what: str) -> None:
    assert mine.keys() == theirs.keys(), what
    for k in mine:
        assert (mine[k] - theirs[k]).abs().max() <= 1e-5, f"{what}: {k}"


def test_an_fsdp2_run_shards_its_moving_reference_and_trains_as_with_a_whole_copy(tiny_model_dir, tmp_path):
    sharded = run(tiny_model_dir, tmp_path, "sharded", "fsdp2", 1, *KL)
    assert sharded.returncode == 0, sharded.stdout[-2000:] + sharded.stderr[-3000:]
    whole = run(tiny_model_dir, tmp_path, "whole", "ddp", 1, *KL)
    assert whole.returncode == 0, whole.stdout[-2000:] + whole.stderr[-3000:]
    part = re.search(LINE.format(r"sharded over 2 ranks \(FSDP2\),"), sharded.stdout)
    copy = re.search(LINE.format("a whole copy on each rank,"), whole.stdout)
    assert part and copy, sharded.stdout[-2000:] + whole.stdout[-2000:]
    assert sharded.stdout.count("reference: ") == 1  # said once, by rank 0
    assert float(part[1]) <= float(copy[1]) / 2 + 0.01  # each rank holds its half (rounded to 0.01)
    kl = {name: _kl(tmp_path / name) for name in ("sharded", "whole")}
    # the step's second mini-batch has moved away from the base model, which the KL term measures
    assert len(kl["sharded"]) == 1 and kl["sharded"][0] > 1e-6, kl
    assert kl["sharded"] == pytest.approx(kl["whole"], rel=1e-5, abs=1e-9)
    ckpts = {name: tmp_path / name / "checkpoints" for name in ("sharded", "whole")}
    for part_name in ("reference", "model"):  # the reference rank 0 put together from the ranks' mixed rows
        _assert_same(*(weights(ckpts[name] / "global_step_1" / part_name) for name in ("sharded", "whole")),
                     f"step 1 {part_name}")
    base = weights(tiny_model_dir)
    moved = weights(ckpts["sharded"] / "global_step_1" / "reference")
    assert max(float((moved[k] - base[k]).abs().max()) for k in moved) > 1e-4  # it did move

