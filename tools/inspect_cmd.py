"""`trtbuild inspect DIR`: an engine set's manifest as a table."""
from __future__ import annotations

from .table import format_table


def add_arguments(p) -> None:
    p.add_argument("dir", help="engine-set folder")
    p.add_argument("--json", action="store_true", help="print the manifest JSON")


def run(args) -> int:
    import json

    from ..engines.manifest import Manifest

    m = Manifest.load(args.dir)
    if args.json:
        print(json.dumps(m.to_dict(), indent=1))
        return 0
    head = [["model", f"{m.model.get('source')} ({m.model.get('kind')}), weights {m.model.get('weights_hash')}"],
            ["backend", m.backend], ["device", m.device], ["dtype", m.dtype],
            ["versions", ", ".join(f"{k} {v}" for k, v in m.versions.items())], ["created", m.created],
            ["build seconds", m.build_seconds], ["profile hash", m.profile_hash]]
    print(format_table(["field", "value"], head, title=f"engine set {args.dir}"))
    rows = [[e.stage, e.mode, e.file, e.dtype, ", ".join(e.buckets), e.build_seconds] for e in m.engines]
    print()
    print(format_table(["stage", "mode", "file", "dtype", "buckets", "build s"], rows))
    for name, cmds in m.commands.items():
        if isinstance(cmds, list):
            print(f"\n{name} commands:")
            for c in cmds:
                print("  " + c)
    return 0
