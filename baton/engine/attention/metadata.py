"""FlashInfer-style paged-attention metadata, built once per batch and shared by every backend.

A batch is ragged: row i brings `q_lens[i]` new tokens whose K/V are appended after
`kv_starts[i]` tokens already in the cache (a cached prefix, earlier prefill chunks or earlier
decode steps). Decode rows are simply rows with one new token. Row i's pages are
`kv_indices[kv_indptr[i]:kv_indptr[i+1]]`; its last page holds `kv_last_page_len[i]` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Page-table metadata of one batch, as both the torch and the FlashInfer backend read it."""

    page_size: int
    qo_indptr: torch.Tensor  # [batch + 1] int32: row i's queries are qo_indptr[i]:qo_indptr[i+1]
    kv_indptr: torch.Tensor  # [batch + 1] int32: row i's pages are kv_indices[kv_indptr[i]:...]
    kv_indices: torch.Tensor  # [total pages] int32
    kv_last_page_len: torch.Tensor  # [batch] int32, in 1..page_size
    positions: torch.Tensor  # [tokens] int64: position of each new token in its sequence
    slot_mapping: torch.Tensor  # [tokens] int64: page * page_size + offset where its K/V go
    # Host-side copies, so backends need no device->host sync to loop over rows.
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]  # cached + new tokens per row

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.q_lens)


@dataclass(frozen=True)
class PageLists:
    """A batch's page-table metadata as plain lists (the fields of AttentionMetadata)."""

    qo_indptr: list[int]
    kv_indptr: list[int]
    kv_indices: list[int]
    kv_last_page_len: list[int]
    positions: list[int]
    slot_mapping: list[int]
    kv_lens: list[int]


def page_lists(
    kv_starts: Sequence[int],
    q_lens: Sequence[int],
    page_tables: Sequence[Sequence[int]],
    page_size: int,
) -> PageLists:
    """The metadata of rows that append `q_lens[i]` tokens after `kv_starts[i]` cached ones, as
    lists: what `build_attention_metadata` turns into tensors and the native decode step into
    C arrays (no torch op, see decode_step.py).

    `page_tables[i]` must cover every token of row i after this step (it may hold more pages,
    pre-allocated for later steps; only the pages in use are listed in kv_indices).
    """
    kv_lens = [start + n for start, n in zip(kv_starts, q_lens)]
    used_pages: list[int] = []
    kv_indptr = [0]
    last_page_len = []
    positions: list[int] = []
    slots: list[int] = []
    for start, n, kv_len, table in zip(kv_starts, q_lens, kv_lens, page_tables):
        if n < 1:
            raise ValueError("every row must bring at least one new token")
        num_pages = -(-kv_len // page_size)
        if len(table) < num_pages:
            raise ValueError(f"page table has {len(table)} pages, {num_pages} needed")
        used_pages.extend(table[:num_pages])
        kv_indptr.append(len(used_pages))
        last_page_len.append(kv_len - (num_pages - 1) * page_size)
        for pos in range(start, kv_len):
            positions.append(pos)
            slots.append(table[pos // page_size] * page_size + pos % page_size)
    qo_indptr = [0]
    for n in q_lens:
        qo_indptr.append(qo_indptr[-1] + n)
    return PageLists(qo_indptr, kv_indptr, used_pages, last_page_len, positions, slots, kv_lens)


def build_attention_metadata(
    kv_starts: Sequence[int],
    q_lens: Sequence[int],
    page_tables: Sequence[Sequence[int]],
    page_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """`page_lists` as the tensors every attention backend reads."""
    lists = page_lists(kv_starts, q_lens, page_tables, page_size)

    def as_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return AttentionMetadata(
        page_size=page_size,
        qo_indptr=as_tensor(lists.qo_indptr, torch.int32),
        kv_indptr=as_tensor(lists.kv_indptr, torch.int32),
        kv_indices=as_tensor(lists.kv_indices, torch.int32),
        kv_last_page_len=as_tensor(lists.kv_last_page_len, torch.int32),
        positions=as_tensor(lists.positions, torch.int64),
        slot_mapping=as_tensor(lists.slot_mapping, torch.int64),
        q_lens=tuple(q_lens),
        kv_lens=tuple(lists.kv_lens),
    )
