"""Human-readable numbers, shared by the verdict, the terminal summary and the HTML page."""

from __future__ import annotations

from collections.abc import Iterable

GIB = 1 << 30
MIB = 1 << 20


def fmt_bytes(n: int | float | None) -> str:
    """'1.2 GiB' / '512.0 MiB' / '-300.0 MiB'; '-' for unknown."""
    if n is None:
        return "-"
    if abs(n) >= GIB:
        return f"{n / GIB:.1f} GiB"
    if abs(n) >= MIB:
        return f"{n / MIB:.1f} MiB"
    return f"{n / 1024:.1f} KiB" if abs(n) >= 1024 else f"{int(n)} B"


def fmt_seconds(s: float | None) -> str:
    """'412.5 ms' / '3.21 s' / '85.0 µs'; '-' for unknown."""
    if s is None:
        return "-"
    if s == 0:
        return "0"
    if abs(s) >= 1:
        return f"{s:.2f} s" if abs(s) < 100 else f"{s:.0f} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.1f} µs"


def fmt_rate(x: float | None, unit: str) -> str:
    """'1.23 M tokens/s' style: three significant digits with a k/M/G prefix."""
    if x is None:
        return "-"
    for factor, prefix in ((1e9, "G "), (1e6, "M "), (1e3, "k ")):
        if abs(x) >= factor:
            return f"{x / factor:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def rank_ranges(ranks: Iterable[int]) -> str:
    """'0-3,8,10-11': a rank set short enough to print for thousands of ranks."""
    out: list[str] = []
    rs = sorted(set(ranks))
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)
