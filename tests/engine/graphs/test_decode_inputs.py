"""A decode step's inputs written into persistent buffers, padded to a bucket: the real rows'
metadata and ids as the eager path builds them, padding rows confined to the dummy page, and the
same addresses step after step (what a captured graph reads)."""

from __future__ import annotations

import random

import pytest
import torch

from baton.engine.attention.metadata import AttentionMetadata, build_attention_metadata
from baton.engine.graphs.decode_inputs import DecodeInputs

PAGE_SIZE, DUMMY_PAGE, MAX_ROWS, MAX_PAGES_PER_ROW = 4, 0, 16, 8


def _inputs() -> DecodeInputs:
    return DecodeInputs(MAX_ROWS, MAX_PAGES_PER_ROW, PAGE_SIZE, DUMMY_PAGE, device="cpu")


def _random_batch(rng: random.Random, rows: int) -> tuple[list[int], list[int], list[list[int]]]:
    """Rows over distinct real pages (never the dummy page), as the page allocator gives them."""
    free = list(range(1, 200))
    rng.shuffle(free)
    kv_starts, tables = [], []
    for _ in range(rows):
        start = rng.randrange(0, PAGE_SIZE * MAX_PAGES_PER_ROW)
        kv_starts.append(start)
        tables.append([free.pop() for _ in range(start // PAGE_SIZE + 1 + rng.randrange(2))])
    ids = [rng.randrange(1000) for _ in range(rows)]
    return ids, kv_starts, tables


def _assert_rows_match(meta: AttentionMetadata, reference: AttentionMetadata, rows: int) -> None:
    assert torch.equal(meta.positions[:rows], reference.positions)
    assert torch.equal(meta.slot_mapping[:rows], reference.slot_mapping)
    assert torch.equal(meta.kv_indptr[: rows + 1], reference.kv_indptr)
    pages = int(reference.kv_indptr[-1])
    assert torch.equal(meta.kv_indices[:pages], reference.kv_indices)
    assert torch.equal(meta.kv_last_page_len[:rows], reference.kv_last_page_len)
    assert meta.kv_lens[:rows] == reference.kv_lens


@pytest.mark.parametrize("seed", range(20))
def test_real_rows_as_the_eager_path_and_padding_only_in_the_dummy_page(seed: int) -> None:
    rng = random.Random(seed)
    rows = rng.randrange(1, MAX_ROWS + 1)
    bucket = rng.randrange(rows, MAX_ROWS + 1)
    ids, kv_starts, tables = _random_batch(rng, rows)
    inputs = _inputs()
    meta = inputs.fill(ids, kv_starts, tables, bucket)
    reference = build_attention_metadata(kv_starts, [1] * rows, tables, PAGE_SIZE)
    _assert_rows_match(meta, reference, rows)
    assert meta.q_lens == (1,) * bucket and meta.batch_size == bucket
    assert torch.equal(meta.qo_indptr, torch.arange(bucket + 1, dtype=torch.int32))
    assert inputs.input_ids[:rows].tolist() == ids
    # Padding rows: one token each, read from and written to the dummy page alone.
    padding_pages = meta.kv_indices[int(reference.kv_indptr[-1]) :]
    assert padding_pages.tolist() == [DUMMY_PAGE] * (bucket - rows)
    assert (meta.slot_mapping[rows:] // PAGE_SIZE == DUMMY_PAGE).all()
    assert meta.kv_lens[rows:] == (1,) * (bucket - rows)
    assert (meta.kv_last_page_len[rows:] == 1).all()
    # No real row ever points into the dummy page.
    assert DUMMY_PAGE not in meta.kv_indices[: int(reference.kv_indptr[-1])].tolist()


def test_every_step_uses_the_same_buffers_and_a_smaller_batch_sees_nothing_stale() -> None:
    rng = random.Random(7)
    inputs = _inputs()
    addresses = {
        name: getattr(inputs, name).data_ptr()
        for name in ("input_ids", "positions", "slot_mapping", "kv_indptr", "kv_indices")
    }
    for rows, bucket in ((12, 16), (3, 4), (1, 1), (9, 16)):
        ids, kv_starts, tables = _random_batch(rng, rows)
        meta = inputs.fill(ids, kv_starts, tables, bucket)
        _assert_rows_match(
            meta, build_attention_metadata(kv_starts, [1] * rows, tables, PAGE_SIZE), rows
        )
        assert meta.positions.data_ptr() == addresses["positions"]
        assert meta.slot_mapping.data_ptr() == addresses["slot_mapping"]
        assert meta.kv_indptr.data_ptr() == addresses["kv_indptr"]
        assert meta.kv_indices.data_ptr() == addresses["kv_indices"]
        assert inputs.input_ids.data_ptr() == addresses["input_ids"]
        assert meta.positions.shape == (bucket,) and meta.kv_indptr.shape == (bucket + 1,)


def test_a_batch_that_does_not_fit_is_refused() -> None:
    inputs = _inputs()
    with pytest.raises(ValueError, match="bucket of 2"):
        inputs.fill([1, 2, 3], [0, 0, 0], [[1], [2], [3]], bucket=2)
    with pytest.raises(ValueError, match="its table has 1"):
        inputs.fill([1], [PAGE_SIZE], [[1]], bucket=1)
    too_long = PAGE_SIZE * MAX_PAGES_PER_ROW
    with pytest.raises(ValueError, match="a row at most 8"):
        inputs.fill([1], [too_long], [list(range(1, 11))], bucket=1)
