"""Progress of a checkpoint's load, by bytes read: a bar on a terminal, a log line at each
quarter elsewhere (a server's log), so that a multi-GB load is never minutes without a line
(issue 45: an 8B file sat 2.5 minutes between the compute plan and the OOM killer)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

logger = logging.getLogger(__name__)

Item = TypeVar("Item")
# Loads smaller than this log no quarters: they take a second or two.
QUIET_BELOW_BYTES = 256 << 20


def with_progress(
    items: Iterable[tuple[Item, int]], total_bytes: int, description: str
) -> Iterator[Item]:
    """Each item of (item, its bytes) in turn, the bytes counted as it is handed out."""
    from tqdm import tqdm

    bar = tqdm(
        total=total_bytes,
        desc=description,
        unit="B",
        unit_scale=True,
        delay=1.0,  # only a load that takes a while shows a bar
        disable=not sys.stderr.isatty(),
    )
    logs = total_bytes >= QUIET_BELOW_BYTES and bar.disable
    done, next_quarter = 0, 1
    with bar:
        for item, num_bytes in items:
            yield item
            done += num_bytes
            bar.update(num_bytes)
            while logs and next_quarter < 4 and done * 4 >= total_bytes * next_quarter:
                logger.info(
                    "%s: %d %% (%.1f of %.1f GiB)",
                    description,
                    25 * next_quarter,
                    done / 2**30,
                    total_bytes / 2**30,
                )
                next_quarter += 1
