"""Runs of integers as text: `0-63, 128, 130-131` (rows, ranks, scale-grid lines a message names)."""

from __future__ import annotations


def ranges(values: list[int], limit: int | None = None) -> str:
    """Sorted `values` as runs; with `limit`, the first `limit` runs and "..."."""
    spans, start = [], None
    for i, value in enumerate(values):
        if start is None:
            start = value
        if i + 1 == len(values) or values[i + 1] != value + 1:
            spans.append(f"{start}" if start == value else f"{start}-{value}")
            start = None
    if limit is not None and len(spans) > limit:
        return ", ".join(spans[:limit]) + ", ..."
    return ", ".join(spans)
