"""The RL loop's frozen reference under torchrun beside an FSDP2 policy: sharded over the trainer's two gloo ranks
(each holding half of it) instead of a whole copy on each, and the run trains exactly as with the whole copy."""

import json
import re

import pytest

from test_distributed_loop import run, weights

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

KL = ("actor.use_kl_loss=true", "actor.kl_loss_coef=0.1", "trainer.save_freq=2", "trainer.max_checkpoints=1")
# actor.ref_sync_steps keeps the reference whole on each rank; past the run's last step it never moves, so the
# reference stays the base model, as the sharded run's does
WHOLE = ("actor.ref_sync_steps=100",)
LINE = r"reference: {} ([\d.]+) MiB"


def test_an_fsdp2_run_shards_its_reference_and_trains_as_with_a_whole_copy(tiny_model_dir, tmp_path):
    sharded = run(tiny_model_dir, tmp_path, "sharded", "fsdp2", 2, *KL)
    assert sharded.returncode == 0, sharded.stdout[-2000:] + sharded.stderr[-3000:]
    whole = run(tiny_model_dir, tmp_path, "whole", "fsdp2", 2, *KL, *WHOLE)
    assert whole.returncode == 0, whole.stdout[-2000:] + whole.stderr[-3000:]
    part = re.search(LINE.format(r"sharded over 2 ranks \(FSDP2\),"), sharded.stdout)
    copy = re.search(LINE.format("a whole copy on each rank,"), whole.stdout)
    assert part and copy, sharded.stdout[-2000:] + whole.stdout[-2000:]
    assert sharded.stdout.count("reference: ") == 1  # said once, by rank 0
    assert float(part[1]) <= float(copy[1]) / 2 + 0.01  # each rank holds its half (rounded to 0.01)
    logs = {name: [json.loads(x) for x in (tmp_path / name / "logs" / "metrics.jsonl").read_text().splitlines()]
            for name in ("sharded", "whole")}
    kl = {name: [x["actor/kl_loss"] for x in rows if "actor/kl_loss" in x] for name, rows in logs.items()}
    assert len(kl["sharded"]) == 2 and kl["sharded"][1] > 1e-6, kl  # the second step's KL term reads the reference
    assert kl["sharded"] == pytest.approx(kl["whole"], rel=1e-5, abs=1e-9)
    mine, theirs = (weights(tmp_path / name / "checkpoints" / "global_step_2" / "model")
                    for name in ("sharded", "whole"))
    assert mine.keys() == theirs.keys()
    for k in mine:
        assert (mine[k] - theirs[k]).abs().max() <= 1e-5, k
