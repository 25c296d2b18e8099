"""The inputs of a decode step written into tensors that live as long as the engine.

A captured CUDA graph reads its inputs from the addresses it was captured with, so each step's
token ids, positions, KV slots and page tables are written into the same buffers, padded to the
batch's bucket (buckets.py). The host fills one pinned staging tensor per dtype and copies each
to the device without waiting (`non_blocking`). Every input id is known on the host here: the
engine resolves the overlap loop's placeholders before (taking them on the device from the
last step's sampled ids waits for a sampler that keeps them there).

Padding rows attend over one token of a page no request owns (`dummy_page`) and write their K
and V there: a replay never touches a real page beyond the batch's own rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from baton.engine.attention.metadata import AttentionMetadata

# Rows of the int64 staging tensor, one value per batch row each.
_IDS, _POSITIONS, _SLOTS = range(3)
# Rows of the int32 staging tensor: kv_indptr and kv_last_page_len (the page indices, of
# another length, have their own).
_INDPTR, _LAST_PAGE_LEN = range(2)


class DecodeInputs:
    """The persistent input buffers of decode steps of up to `max_rows` rows, each row over at
    most `max_pages_per_row` pages; `fill` writes one batch into them."""

    def __init__(
        self,
        max_rows: int,
        max_pages_per_row: int,
        page_size: int,
        dummy_page: int,
        device: torch.device | str,
    ) -> None:
        self.max_rows, self.max_pages_per_row = max_rows, max_pages_per_row
        self.page_size, self.dummy_page = page_size, dummy_page
        self.device = torch.device(device)
        max_pages = max_rows * max_pages_per_row

        def device_buffer(size: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(size, dtype=dtype, device=self.device)

        self.input_ids = device_buffer(max_rows, torch.int64)
        self.positions = device_buffer(max_rows, torch.int64)
        self.slot_mapping = device_buffer(max_rows, torch.int64)
        self.kv_indptr = device_buffer(max_rows + 1, torch.int32)
        self.kv_last_page_len = device_buffer(max_rows, torch.int32)
        self.kv_indices = device_buffer(max_pages, torch.int32)
        # A decode row has one query: qo_indptr is the same for every batch.
        self.qo_indptr = torch.arange(max_rows + 1, dtype=torch.int32, device=self.device)
        # Pinned where the device is a GPU, so the copies below really do not wait.
        pinned = self.device.type == "cuda"
        self._host_int64 = torch.zeros(3, max_rows, dtype=torch.int64, pin_memory=pinned)
        self._host_int32 = torch.zeros(2, max_rows + 1, dtype=torch.int32, pin_memory=pinned)
        self._host_indices = torch.zeros(max_pages, dtype=torch.int32, pin_memory=pinned)
        # On a GPU, marks when the copies out of the staging tensors are done (on the CPU the
        # copies are done when they return).
        self._copied = torch.cuda.Event() if pinned else None

    def fill(
        self,
        input_ids: Sequence[int],
        kv_starts: Sequence[int],
        page_tables: Sequence[Sequence[int]],
        bucket: int,
    ) -> AttentionMetadata:
        """Write a decode batch (row i: one token, `input_ids[i]`, after `kv_starts[i]` cached
        ones) padded to `bucket` rows, and return its metadata as views of the buffers (the
        host copies of its lengths included, as every backend reads them)."""
        rows = len(input_ids)
        if not rows <= bucket <= self.max_rows:
            raise ValueError(f"{rows} rows in a bucket of {bucket} (of at most {self.max_rows})")
        page_size = self.page_size
        per_row: list[list[int]] = [[], [], []]  # as _IDS, _POSITIONS, _SLOTS
        indptr, last_page_lens, indices, kv_lens = [0], [], [], []
        for row in range(bucket):
            if row < rows:
                kv_len, table = kv_starts[row] + 1, page_tables[row]
                token = input_ids[row]
            else:  # padding: one token in the dummy page, its K/V written there
                kv_len, table, token = 1, (self.dummy_page,), 0
            num_pages = -(-kv_len // page_size)
            if num_pages > self.max_pages_per_row or len(table) < num_pages:
                raise ValueError(
                    f"row {row} needs {num_pages} pages; its table has {len(table)}, a row at "
                    f"most {self.max_pages_per_row}"
                )
            position = kv_len - 1
            slot = table[position // page_size] * page_size + position % page_size
            for values, value in zip(per_row, (token, position, slot)):
                values.append(value)
            indices.extend(table[:num_pages])
            indptr.append(len(indices))
            last_page_lens.append(kv_len - (num_pages - 1) * page_size)
            kv_lens.append(kv_len)
        if self._copied is not None:
            # The staging tensors are about to be rewritten: the last step's copies out of them
            # must be done (they were queued long before; this rarely waits).
            self._copied.synchronize()
        self._host_int64[:, :bucket] = torch.tensor(per_row, dtype=torch.int64)
        self._host_int32[_INDPTR, : bucket + 1] = torch.tensor(indptr, dtype=torch.int32)
        self._host_int32[_LAST_PAGE_LEN, :bucket] = torch.tensor(last_page_lens, dtype=torch.int32)
        self._host_indices[: len(indices)] = torch.tensor(indices, dtype=torch.int32)
        self._copy_in(bucket, len(indices))
        return AttentionMetadata(
            page_size=page_size,
            qo_indptr=self.qo_indptr[: bucket + 1],
            kv_indptr=self.kv_indptr[: bucket + 1],
            kv_indices=self.kv_indices[: len(indices)],
            kv_last_page_len=self.kv_last_page_len[:bucket],
            positions=self.positions[:bucket],
            slot_mapping=self.slot_mapping[:bucket],
            q_lens=(1,) * bucket,
            kv_lens=tuple(kv_lens),
        )

    def _copy_in(self, bucket: int, used_pages: int) -> None:
        host64, host32 = self._host_int64, self._host_int32
        self.input_ids[:bucket].copy_(host64[_IDS, :bucket], non_blocking=True)
        self.positions[:bucket].copy_(host64[_POSITIONS, :bucket], non_blocking=True)
        self.slot_mapping[:bucket].copy_(host64[_SLOTS, :bucket], non_blocking=True)
        self.kv_indptr[: bucket + 1].copy_(host32[_INDPTR, : bucket + 1], non_blocking=True)
        self.kv_last_page_len[:bucket].copy_(host32[_LAST_PAGE_LEN, :bucket], non_blocking=True)
        self.kv_indices[:used_pages].copy_(self._host_indices[:used_pages], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
