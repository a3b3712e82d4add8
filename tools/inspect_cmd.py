"""`trtbuild inspect DIR`: an engine set's manifest as a table; `--verify` re-hashes every file of the set."""
from __future__ import annotations

from .table import format_table


def add_arguments(p) -> None:
    p.add_argument("dir", help="engine-set folder")
    p.add_argument("--json", action="store_true", help="print the manifest JSON")
    p.add_argument("--verify", action="store_true",
                   help="re-hash every file against the manifest's sha256 (exit 1 when one differs or is missing)")


def run(args) -> int:
    import json

    from ..engines.manifest import Manifest

    m = Manifest.load(args.dir)
    checked = m.verify(args.dir, raise_on_error=False) if args.verify else None
    bad = [(f, s) for f, s in (checked or []) if s != "ok"]
    if args.json:
        d = m.to_dict()
        if checked is not None:
            d["verify"] = {"passed": not bad, "files": dict(checked)}
        print(json.dumps(d, indent=1))
        return 1 if bad else 0
    head = [["model", f"{m.model.get('source')} ({m.model.get('kind')}), weights {m.model.get('weights_hash')}"],
            ["backend", m.backend], ["device", m.device], ["dtype", m.dtype],
            ["versions", ", ".join(f"{k} {v}" for k, v in m.versions.items())], ["created", m.created],
            ["build seconds", m.build_seconds], ["profile hash", m.profile_hash]]
    for name, digest in (m.model.get("files") or {}).items():
        head.append([f"model {name}", f"sha256 {digest}"])
    print(format_table(["field", "value"], head, title=f"engine set {args.dir}"))
    rows = [[e.stage, e.mode, e.file, e.dtype, ", ".join(e.buckets), e.build_seconds] for e in m.engines]
    print()
    print(format_table(["stage", "mode", "file", "dtype", "buckets", "build s"], rows))
    for name, cmds in m.commands.items():
        if isinstance(cmds, list):
            print(f"\n{name} commands:")
            for c in cmds:
                print("  " + c)
    if checked is not None:
        print()
        print(format_table(["file", "sha256 (manifest)", "check"], [[f, m.files[f][:16] + "..", s] for f, s in checked],
                           title=f"verify: {len(checked) - len(bad)} of {len(checked)} files match"))
        print("PASS" if not bad else f"FAIL ({len(bad)} of {len(checked)} files): " + ", ".join(f for f, _ in bad))
    return 1 if bad else 0
