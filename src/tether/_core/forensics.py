"""Failure forensics over a journal, as in the stream-cut investigation: which children fail,
against the base rate of all children, by lifetime, nesting depth, model and tool surface."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

LIFETIME_BUCKETS: tuple[tuple[float, str], ...] = (
    (60.0, "<1m"), (360.0, "1-6m"), (900.0, "6-15m"), (1800.0, "15-30m"),
    (float("inf"), ">=30m"),
)


@dataclass(frozen=True)
class ChildFacts:
    lifetime: float  # seconds from delegation to its end
    depth: int  # 0 for a child of the orchestrator
    model: str
    surface: str  # the sorted tool surface, as one label
    failure: str | None  # e.g. "stream_cut:stream_incomplete"


def lifetime_bucket(seconds: float) -> str:
    return next(label for bound, label in LIFETIME_BUCKETS if seconds < bound)


def _dimension(children: list[ChildFacts], failed: list[ChildFacts],
               key: Callable[[ChildFacts], str]) -> list[dict[str, Any]]:
    every, bad = Counter(key(c) for c in children), Counter(key(c) for c in failed)
    rows = []
    for value, count in sorted(every.items(), key=lambda kv: (-bad[kv[0]], kv[0])):
        failed_share = bad[value] / len(failed) if failed else 0.0
        base_share = count / len(children)
        rows.append({
            "value": value, "failed": bad[value], "all": count,
            "failed_share": round(failed_share, 4), "base_share": round(base_share, 4),
            "enrichment": round(failed_share / base_share, 3) if base_share else None,
            "failure_rate": round(bad[value] / count, 4),
        })
    return rows


def analyze(children: Iterable[ChildFacts], failure_prefix: str = "stream_cut") -> dict[str, Any]:
    """Counts and enrichment ratios (failed share / base share) for each dimension."""
    kids = list(children)
    failed = [c for c in kids if c.failure and c.failure.startswith(failure_prefix)]

    def median(group: list[ChildFacts]) -> float | None:
        return round(statistics.median(c.lifetime for c in group), 3) if group else None

    return {
        "failure": failure_prefix,
        "children": len(kids),
        "failures": len(failed),
        "failure_rate": round(len(failed) / len(kids), 4) if kids else 0.0,
        "median_lifetime": {"failed": median(failed), "all": median(kids)},
        "dimensions": {
            "lifetime": _dimension(kids, failed, lambda c: lifetime_bucket(c.lifetime)),
            "depth": _dimension(kids, failed, lambda c: str(c.depth)),
            "model": _dimension(kids, failed, lambda c: c.model),
            "surface": _dimension(kids, failed, lambda c: c.surface),
        } if kids else {},
    }
