"""TRL's bfd_split packing (its older name bfd-requeue) and eval_packing: the pieces of a long row binned as TRL's
`pack_dataset` bins them, worked by hand on tiny token lists, the flags, and one tiny in-process run whose held-out
rows are packed."""

import json
import sys

from alignrl.data.sft_rows import EncodedRow, SFTKeys, SFTRow, encode_rows
from alignrl.preference import sft_packing
from alignrl.preference.sft_cli import parse_sft, sft_main
from alignrl.preference.sft_packing import collate_bins, pack_dataset, split_pieces


def _rows(ids: list[list[int]], masks: list[list[int]] | None = None) -> list[EncodedRow]:
    masks = masks or [[1] * len(r) for r in ids]
    return [EncodedRow(r, [bool(m) for m in mask], i) for i, (r, mask) in enumerate(zip(ids, masks))]


TRL_IDS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]]  # TRL's pack_dataset docstring example, seq_length 4


def test_bfd_split_packs_a_long_rows_pieces_as_trl_does_where_bfd_drops_them():
    packed, dropped = pack_dataset(_rows(TRL_IDS), 4, "bfd_split")
    # TRL: pieces [1 2 3 4] [5] [6 7] [8 9 10] [11], longest first, each into the least room that fits it
    assert [p.ids for p in packed] == [[1, 2, 3, 4], [8, 9, 10, 5], [6, 7, 11]] and dropped == 0
    assert [p.lengths for p in packed] == [(4,), (3, 1), (2, 1)]  # TRL's seq_lengths
    bfd, _ = pack_dataset(_rows(TRL_IDS), 4, "bfd")  # the 5 is cut off
    assert [p.ids for p in bfd] == [[1, 2, 3, 4], [8, 9, 10, 11], [6, 7]]
    assert [p.lengths for p in bfd] == [(4,), (3, 1), (2,)]
    # position ids start again at each piece, and no piece's first token is a target
    batch = collate_bins(packed, 0, 1.0)
    assert batch.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 0, 0]]  # the last: 1 of filler
    assert batch.loss_mask.tolist() == [[False, True, True, True], [False, True, True, False],
                                        [False, True, False, False]]


def test_the_masks_follow_the_pieces_token_for_token():
    # TRL's docstring mask column; a piece is cut every 4 tokens from the row's start, the last one shorter
    masks = [[1, 1, 1, 0, 0], [1, 0], [1, 1, 0], [1]]
    assert [(p.ids, p.trained) for p in split_pieces(_rows([list(range(10))], [[1] * 6 + [0] * 4]), 4)] == [
        ([0, 1, 2, 3], [True] * 4), ([4, 5, 6, 7], [True, True, False, False]), ([8, 9], [False, False])]
    packed, dropped = pack_dataset(_rows(TRL_IDS, masks), 4, "bfd_split")
    # TRL's packed masks [1 1 1 0] [1 1 0 | 0] [1 0 | 1], less each piece's first token (TRL's labels at position
    # 0 are -100): the last packed row trains nothing and is dropped, counted
    assert [(p.ids, p.trained) for p in packed] == [([1, 2, 3, 4], [False, True, True, False]),
                                                    ([8, 9, 10, 5], [False, True, False, False])]
    assert dropped == 1


def test_split_pieces_stay_in_their_block_of_rows(monkeypatch):
    monkeypatch.setattr(sft_packing, "PACK_BLOCK", 2)  # TRL splits and bins each datasets.map batch apart
    packed, _ = pack_dataset(_rows(TRL_IDS), 4, "bfd_split")
    assert [p.ids for p in packed] == [[1, 2, 3, 4], [6, 7, 5], [8, 9, 10, 11]]


def test_the_flags_and_a_bad_strategy_name(capsys):
    base = ["train_files=[x.jsonl]"]
    assert (parse_sft(base).eval_packing, parse_sft(base).packing_strategy) == (None, "micro_batch")
    trl = parse_sft(["--model_name_or_path", "m", "--dataset_name", "x.jsonl", "--packing", "--packing_strategy",
                     "bfd-requeue", "--eval_packing", "false"])
    assert (trl.packing, trl.packing_strategy, trl.eval_packing) == (True, "bfd_split", False)
    evals = parse_sft(["--model_name_or_path", "m", "--dataset_name", "x.jsonl", "--eval_packing"])
    assert (evals.packing, evals.eval_packing, evals.packing_strategy) == (False, True, "bfd")  # TRL's strategy
    assert parse_sft([*base, "--packing_strategy=bfd_split", "--eval_packing"]).eval_packing is True
    assert parse_sft([*base, "eval_packing=true", "packing_strategy=bfd-requeue"]).packing_strategy == "bfd_split"
    capsys.readouterr()  # the notes of the line in TRL's spelling
    assert sft_main([*base, "--packing", "--packing_strategy", "bfd-split"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "packing_strategy='bfd-split'" in err and "bfd_split" in err


def _texts(n: int, start: int) -> list[dict]:
    return [{"text": " ".join(str(start + i + k) for k in range(2 + 4 * (i % 5)))} for i in range(n)]


def test_a_run_packs_its_held_out_rows_split_as_its_training_rows(tiny_model_dir, tmp_path):
    from alignrl.models.loader import load_tokenizer

    train, held = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in _texts(6, 0)))
    held.write_text("".join(json.dumps(r) + "\n" for r in _texts(5, 50)))
    assert sft_main(["--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(train), f"eval_files=[{held}]",
                     "--packing", "--packing_strategy", "bfd-requeue", "--max_length", "16",
                     "--per_device_train_batch_size", "2", "--max_steps", "1", "--gradient_checkpointing", "false",
                     "--output_dir", str(tmp_path / "out")]) == 0
    res = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert (res["packing_strategy"], res["eval_packing"], res["steps"]) == ("bfd_split", True, 1)
    tok = load_tokenizer(tiny_model_dir, chat=False)
    rows = [SFTRow("x", text=r["text"]) for r in _texts(5, 50)]
    whole, _, _ = encode_rows(tok, rows, SFTKeys(), sys.maxsize)
    assert max(len(e.ids) for e in whole) > 16  # some held-out rows are split
    packed, _ = pack_dataset(whole, 16, "bfd_split")
    cut, _, _ = encode_rows(tok, rows, SFTKeys(), 16)
    # measured on the split pieces, packed: every token past max_length but each piece's first
    assert res["before"]["tokens"] == res["after"]["tokens"] == sum(p.n_trained for p in packed)
    assert sum(p.n_trained for p in packed) != sum(e.n_trained for e in cut)
    assert res["eval_packed_rows"] == len(packed) < len(split_pieces(whole, 16))
    assert res["before"]["loss"] > 0
