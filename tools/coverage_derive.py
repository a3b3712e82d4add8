"""`trtbuild coverage --derive-profile OUT.yaml`: a bucket profile from the recorded (or simulated) call shapes, and
the bucket hit rates per stage/mode of the old profile and the derived one on the same calls (table, report.json
`profile_comparison`, hit_rates.png)."""
from __future__ import annotations

import os

from .coverage_profile import derive_profile, write_profile
from .coverage_sim import hit_rates, rate_cached, rate_calls
from .table import format_table

STAGE_MODES = [(s, m) for s in ("dit", "hift") for m in ("stream", "offline")]


def tables_of(profile) -> dict:
    return {(s, m): profile.table(s, m) for s, m in STAGE_MODES if profile.buckets(s, m)}


def calls_from_shapes(shapes: list[dict]) -> list[tuple]:
    """Unrated call tuples from report.json `shapes` (one per call)."""
    out = []
    for s in shapes:
        stage, mode = s["stage_mode"].split("/")
        out += [(stage, mode, s["b"], s["n"], None, 0.0, None)] * s["calls"]
    return out


def with_cached(rates: dict, cached_calls: list[tuple] | None, profile) -> dict:
    """`hit_rates` output with a "dit/cached" row for `cached_calls` in `profile`'s cached-hop grid (and in the
    total)."""
    if not cached_calls:
        return rates
    c = rate_cached(cached_calls, profile.cached_grid)
    total = rates.pop("total")
    rates["dit/cached"] = c
    calls, hits = total["calls"] + c["calls"], total["hits"] + c["hits"]
    rates["total"] = {"calls": calls, "hits": hits, "hit_rate": hits / calls if calls else float("nan")}
    return rates


def derive_and_compare(calls: list[tuple], base, old_label: str, out_yaml: str, max_buckets: int, how: str,
                       simulated: bool, cached_calls: list[tuple] | None = None, max_cached_graphs: int = 64) -> dict:
    """Derive the profile from `calls` (unrated; and `cached_calls`: the dit.cached grid), write it to `out_yaml`,
    rate the calls against `base` (the old profile; simulated calls also as before final HiFT stream windows had
    buckets) and the derived one."""
    from ..runtime.stages.profile import load_profile

    prof, summary = derive_profile(calls, base, max_buckets, description="derived by trtbuild coverage "
                                   "--derive-profile from call shapes (see the header comment)",
                                   cached_calls=cached_calls, max_cached_graphs=max_cached_graphs)
    old_tables = tables_of(base)
    comparison = {}
    if simulated:
        comparison[f"{old_label} (final HiFT windows eager)"] = with_cached(
            hit_rates(rate_calls(calls, old_tables, True)), cached_calls, base)
    comparison[old_label] = with_cached(hit_rates(rate_calls(calls, old_tables)), cached_calls, base)
    derived_label = os.path.basename(out_yaml)
    n_buckets = {sm: g.get("graphs", len(g["batch"]) * len(g["frames"])) for sm, g in summary.items()}
    header = (f"Derived by `trtbuild coverage --derive-profile` (tools/coverage_profile.py) from {how}.\n"
              f"Base (kept: model, dtypes, options, AR stage): {old_label}. Per stage/mode a batch x frames grid "
              f"covering the calls\nwithin max_padding_waste {prof['max_padding_waste']:g}, at most {max_buckets} "
              f"buckets each: " + ", ".join(f"{sm} {n}" for sm, n in n_buckets.items()) + ".\n"
              "Final streaming HiFT windows are sized at n + 4 frames (BucketedStreamDecoder runs them in the stream "
              "buckets plus a tail graph).\n"
              "Bucket hit rates on those calls (old -> derived): "
              + ", ".join(f"{sm} {100 * comparison[old_label][sm]['hit_rate']:.1f}%"
                          for sm in summary if sm in comparison[old_label]) + " -> ")
    write_profile(prof, out_yaml, header + "(see below)")
    derived = load_profile(out_yaml)
    comparison[derived_label] = with_cached(hit_rates(rate_calls(calls, tables_of(derived))), cached_calls, derived)
    header = header.replace("(see below)", "") + ", ".join(
        f"{sm} {100 * comparison[derived_label][sm]['hit_rate']:.1f}%" for sm in summary
        if sm in comparison[derived_label]) + "."
    if "dit/cached" in summary:
        old_c, new_c = comparison[old_label]["dit/cached"], comparison[derived_label]["dit/cached"]
        header += (f"\ndit.cached (batch = requests; frames = new frames; prefix = cached frames, within "
                   f"x{summary['dit/cached']['prefix_ratio']:g} of each call's): {old_c['graphs']} -> {new_c['graphs']} "
                   f"graphs, padded work (coverage_sim.hop_work) x{old_c['work_ratio']:.3f} -> "
                   f"x{new_c['work_ratio']:.3f} on the {new_c['calls']} cached-hop calls.")
    write_profile(prof, out_yaml, header)
    return {"comparison": comparison, "derivation": summary, "profile": out_yaml}


def format_comparison(comparison: dict) -> str:
    labels = list(comparison)
    cats = [c for c in next(iter(comparison.values())) if c != "total"] + ["total"]
    rows = [[c, comparison[labels[0]][c]["calls"]] + [f"{100 * comparison[lab][c]['hit_rate']:.1f}"
                                                       if c in comparison[lab] else "-" for lab in labels]
            for c in cats]
    return format_table(["stage/mode", "calls"] + [f"hit % {lab}" for lab in labels], rows,
                        title="\nbucket hit rate, same calls")
