"""Tables for every CLI report (one formatter, used everywhere): rich tables that wrap long cells to the terminal
width (or $COLUMNS, 120 when not a terminal) instead of running off the screen."""
from __future__ import annotations

import io
import os
import shutil
import sys


def _cell(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 1000 or abs(v) < 1e-3:
            return f"{v:.3e}"
        return f"{v:.4g}"
    return str(v)


def table_width() -> int:
    if os.environ.get("COLUMNS", "").isdigit():
        return max(40, int(os.environ["COLUMNS"]))
    if sys.stdout.isatty():
        return max(40, shutil.get_terminal_size((120, 24)).columns)
    return 120


def format_table(headers: list[str], rows: list[list], title: str | None = None, width: int | None = None) -> str:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    cells = [[_cell(c) for c in r] for r in rows]
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="", title=None)
    for i, h in enumerate(headers):
        numeric = bool(cells) and all(_is_num(r[i]) for r in cells if i < len(r))
        t.add_column(h, justify="right" if numeric else "left", overflow="fold")
    for r in cells:
        t.add_row(*r)
    buf = io.StringIO()
    Console(file=buf, width=width or table_width(), no_color=True, color_system=None, highlight=False,
            force_terminal=False, soft_wrap=False).print(t)
    body = "\n".join(line.rstrip() for line in buf.getvalue().rstrip("\n").split("\n"))
    return f"{title}\n{body}" if title else body


def _is_num(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def emit(text: str, out: str | None = None) -> None:
    """A report's text to stdout and, given a path, to that file (the benchmarks/ scripts' markdown tables)."""
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
