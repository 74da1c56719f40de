"""Writing a benchmark's rows: the CSV file (header first) and the file-name tag of a GPU."""

from __future__ import annotations

import csv
import os
import re
from typing import Dict, List, Optional, Sequence

__all__ = ["file_tag", "write_rows_csv"]


def file_tag(name: str) -> str:
    """``name`` (a GPU's name) as a lower-case file-name part: each run of other characters than
    ASCII letters and digits becomes one ``_`` (``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia_h100_80gb_hbm3"``)."""
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").lower()


def write_rows_csv(path: str, rows: List[Dict], fieldnames: Optional[Sequence[str]] = None, *,
                   append: bool = False) -> None:
    """Write ``rows`` (dicts) to the CSV file ``path`` with the header ``fieldnames`` (default: the
    first row's keys). ``append=True`` adds them to an existing file (its header is kept; a new file
    gets one); otherwise the file is written anew."""
    new = not (append and os.path.exists(path))
    with open(path, "a" if append else "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(fieldnames) if fieldnames is not None else list(rows[0]))
        if new:
            w.writeheader()
        w.writerows(rows)
