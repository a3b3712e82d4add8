"""Plain-text tables for every CLI report (one formatter, used everywhere)."""
from __future__ import annotations


def _cell(v) -> str:
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 1000 or abs(v) < 1e-3:
            return f"{v:.3e}"
        return f"{v:.4g}"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return str(v)


def format_table(headers: list[str], rows: list[list], title: str | None = None) -> str:
    cells = [[_cell(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [title] if title else []
    out += [line, "  ".join("-" * w for w in widths)]
    for r in cells:
        out.append("  ".join(c.rjust(w) if _is_num(c) else c.ljust(w) for c, w in zip(r, widths)))
    return "\n".join(out)


def _is_num(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False
