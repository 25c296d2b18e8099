"""Where every benchmark writes its `--output-json` report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(path: str | Path | None, report: Any) -> None:
    """Write `report` as indented JSON to `path` (folders created), if a path was given; values
    JSON has no type for (paths, dates) are written as strings."""
    if path is None or path == "":
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
