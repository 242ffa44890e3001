"""TRL's packing of the whole SFT dataset (`packing_strategy=bfd|wrapped`), in process on the tiny test model: TRL's
best-fit-decreasing bins, the wrapped cut, a packed row's loss as the sum of its rows' own losses, and a run in TRL's
spelling whose optimizer steps follow the packed rows."""

import json

import pytest
import torch

from alignrl.data.sft_rows import EncodedRow, SFTKeys, SFTRow, collate_rows, encode_rows
from alignrl.preference import sft_packing
from alignrl.preference.sft import schedule, step_tokens, steps_per_epoch, summed_loss
from alignrl.preference.sft_cli import SFTConfig, sft_main
from alignrl.preference.sft_packing import collate_bins, dataset_bins, pack_dataset

ROWS = [SFTRow("x", prompt=f"count from {i}", completion=" ".join(str(i + k) for k in range(1 + i % 4)))
        for i in range(6)]


def _rows(lengths: list[int]) -> list[EncodedRow]:
    """Rows of distinct token ids, the first two tokens of each untrained (a prompt), the rest trained."""
    out, at = [], 0
    for i, n in enumerate(lengths):
        out.append(EncodedRow(list(range(at, at + n)), [k >= 2 for k in range(n)], i))
        at += n
    return out


def test_bfd_bins_are_trls_longest_first_into_the_least_room_that_fits():
    # 9, 6, 5 open bins (rooms 1, 4, 5); 4 fills the 6's; 3 goes to the 5's (room 5, not 1); 1 to the 9's
    assert dataset_bins([5, 9, 3, 6, 1, 4], 10) == [[1, 4], [3, 5], [0, 2]]
    # two bins left with room 1: the one that got there first (the second bin) takes the 1, as TRL's queue does
    assert dataset_bins([7, 4, 1, 2, 5], 10) == [[0, 3], [4, 1, 2]]
    assert dataset_bins([3, 3, 3], 10) == [[0, 1, 2]]  # equal lengths in their order


def test_bfd_keeps_every_row_whole_once_within_max_length_and_apart():
    lengths = [5, 9, 3, 6, 1, 4, 10, 2]
    rows = _rows(lengths)
    packed, dropped = pack_dataset(rows, 10, "bfd")
    assert dropped == 0 and [p.index for p in packed] == list(range(len(packed)))
    assert all(len(p.ids) == sum(p.lengths) <= 10 for p in packed) and len(packed) < len(rows)
    segments = []
    for p in packed:
        at = 0
        for n in p.lengths:
            segments.append((p.ids[at:at + n], p.trained[at:at + n]))
            at += n
    # each row once, whole, with its trained tokens, except that no row's first token is a target
    assert sorted(s[0] for s in segments) == sorted(r.ids for r in rows)
    by_first = {r.ids[0]: r for r in rows}
    for ids, trained in segments:
        assert not trained[0] and trained[1:] == by_first[ids[0]].trained[1:]
    assert sum(p.n_trained for p in packed) == sum(r.n_trained for r in rows)


def test_wrapped_cuts_the_rows_end_to_end_every_max_length_within_each_block(monkeypatch):
    rows = _rows([5, 9, 4])
    packed, dropped = pack_dataset(rows, 4, "wrapped")
    flat = [t for r in rows for t in r.ids]
    assert [p.ids for p in packed] == [flat[i:i + 4] for i in range(0, 18, 4)] and dropped == 0
    assert packed[1].trained == [True, False, False, True]  # the first row's end, the second's prompt mid-row
    assert all(p.lengths == () for p in packed)  # one text each: attention crosses the rows in it
    monkeypatch.setattr(sft_packing, "PACK_BLOCK", 2)  # TRL packs datasets.map's batches one by one
    blocks, _ = pack_dataset(rows, 4, "wrapped")
    assert [len(p.ids) for p in blocks] == [4, 4, 4, 2, 4]
    # a piece of prompt alone trains nothing: dropped and counted
    assert pack_dataset(_rows([2, 2, 4]), 4, "wrapped")[1] == 1


def test_a_packed_epoch_trains_every_packed_row_once_the_last_partial_batch_too():
    cfg = SFTConfig(train_files=["x"], packing=True, packing_strategy="bfd", batch_size=2,
                    gradient_accumulation_steps=2)
    rows = _rows([3] * 11)  # 11 packed rows, global batches of 8 over 2 ranks: one whole step and a partial one
    assert steps_per_epoch(11, cfg, 2) == 2 and steps_per_epoch(16, cfg, 2) == 2
    for epoch in (0, 1):
        ranks = [schedule(11, cfg, 2, rank, epoch) for rank in (0, 1)]
        assert [len(r) for r in ranks] == [4, 4]  # every rank runs the same micro-batches: 2 steps of 2
        seen = [j for r in ranks for b in r for j in b if j >= 0]
        assert sorted(seen) == list(range(11))
        assert ranks[1][-1] == [-1]  # no row left for it: a filler, trained nowhere
        assert step_tokens(rows, cfg, 2, epoch) == [8.0, 3.0]
    unpacked = SFTConfig(train_files=["x"], packing=True, batch_size=2, gradient_accumulation_steps=2)
    assert steps_per_epoch(11, unpacked, 2) == 1  # micro-batch packing: whole global batches, as padded


@pytest.fixture(scope="module")
def rows_and_model(tiny_model_dir):
    from alignrl.models.loader import load_causal_lm, load_tokenizer

    tok = load_tokenizer(tiny_model_dir, chat=False)
    encoded, _, _ = encode_rows(tok, ROWS, SFTKeys(completion_only=False), 64)
    return encoded, tok.pad_token_id, load_causal_lm(tiny_model_dir, "float32", "model_path")


@pytest.mark.parametrize("one_row", [False, True], ids=["rows", "one_row"])
def test_a_packed_rows_loss_is_the_sum_of_its_rows_own_losses(rows_and_model, one_row):
    encoded, pad, model = rows_and_model
    cfg, cpu = SFTConfig(train_files=["x"], bf16="false"), torch.device("cpu")
    packed, _ = pack_dataset(encoded, 40, "bfd")
    assert len(packed) < len(encoded) and max(len(p.lengths) for p in packed) > 1
    with torch.no_grad():
        total, n = summed_loss(model, collate_bins(packed, pad, 1.0, one_row), cfg, cpu)
        alone = [summed_loss(model, collate_rows([e], pad, 1.0), cfg, cpu) for e in encoded]
    # every row's first token is no target anyway (nothing before it in its own row)
    assert n == sum(k for _, k in alone) == sum(e.n_trained for e in encoded)
    torch.testing.assert_close(total, sum(t for t, _ in alone), rtol=1e-5, atol=1e-4)


def test_a_line_in_trls_spelling_packs_the_dataset_and_steps_over_packed_rows(tiny_model_dir, tmp_path):
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": f"count from {i}", "completion": " ".join(str(i + k) for k in range(1 + i % 4))}
            for i in range(16)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = sft_main(["--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(data), "--packing",
                   "--per_device_train_batch_size", "2", "--num_train_epochs", "2", "--max_length", "64",
                   "--gradient_checkpointing", "false", "--output_dir", str(tmp_path / "out"), "--logging_dir",
                   str(tmp_path / "logs"), "report_to=[jsonl]", "--logging_steps", "1"])
    assert rc == 0
    res = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert (res["packing_strategy"], res["train_rows"]) == ("bfd", 16)
    # rows of 14..25 tokens, several in a packed row: the batches count packed rows, the last partial one kept
    assert 2 < res["packed_rows"] < 16 and res["steps"] == -(-res["packed_rows"] // 2) * 2
    steps = [json.loads(line)["step"] for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
             if "train/loss" in line]
    assert steps == list(range(1, res["steps"] + 1))
    # fewer rows than one global batch: packed, they still train one partial step (TRL's Trainer would)
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    assert sft_main(["--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(few), "--packing",
                     "--per_device_train_batch_size", "4", "--max_steps", "1", "--max_length", "64",
                     "--gradient_checkpointing", "false", "--output_dir", str(tmp_path / "few_out")]) == 0
