"""Zero the GPU code of other architectures in a CUDA library's fat binaries, keeping one (default sm_90, the H200),
so that the library compresses to a fraction of its size for the trip to the GPU machine (64 MiB per device call).

A CUDA library holds one fat-binary container per translation unit (magic 0xBA55ED50), each with one entry per
architecture (ELF cubin or PTX). The CUDA runtime picks the entry matching the device (sm_90 on an H200) and never
reads the others. This tool overwrites the PAYLOAD of the other entries with zeros, only in containers that have an
entry for the kept architecture; headers, sizes and offsets are untouched (the ELF file keeps its layout), and
containers without such an entry are left whole. onnxruntime-gpu 1.31.1's libonnxruntime_providers_cuda.so: 609
containers, 600 with sm_90 cubins (77 MB of 219 MB of fat binaries); no PTX.

    python benchmarks/ort_fatbin_strip.py LIB.so [--keep 90]     # rewrites LIB.so in place; prints a summary
"""
from __future__ import annotations

import argparse
import collections
import mmap
import struct

MAGIC = struct.pack("<I", 0xBA55ED50)


def entries(buf, start: int, size: int):
    """(offset, header_size, padded_payload_size, kind, sm) of each entry of the container at `start`."""
    off, end = start + 16, start + 16 + size
    while off < end:
        kind, _ver, hsz, pad = struct.unpack_from("<HHIQ", buf, off)
        sm = struct.unpack_from("<I", buf, off + 28)[0]
        if hsz < 32 or off + hsz + pad > end:
            raise ValueError(f"malformed fat-binary entry at {off:#x}")
        yield off, hsz, pad, kind, sm
        off += hsz + pad


def containers(buf):
    pos = 0
    while True:
        i = buf.find(MAGIC, pos)
        if i < 0:
            return
        _ver, hsz, size = struct.unpack_from("<HHQ", buf, i + 4)
        if hsz == 16 and size and i + 16 + size <= len(buf):
            yield i, size
            pos = i + 16 + size
        else:
            pos = i + 4


def strip(path: str, keep: int = 90, dry_run: bool = False) -> dict:
    stats = collections.Counter()
    with open(path, "r+b") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ if dry_run else mmap.ACCESS_WRITE)
        for start, size in list(containers(buf)):
            es = list(entries(buf, start, size))
            stats["containers"] += 1
            if not any(kind == 2 and sm == keep for _, _, _, kind, sm in es):
                stats["containers_kept_whole"] += 1
                continue
            for off, hsz, pad, kind, sm in es:
                if kind == 2 and sm == keep:
                    stats["kept_bytes"] += pad
                    continue
                stats["zeroed_bytes"] += pad
                stats["zeroed_entries"] += 1
                if not dry_run:
                    buf[off + hsz:off + hsz + pad] = bytes(pad)
        if not dry_run:
            buf.flush()
        buf.close()
    return dict(stats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("library")
    p.add_argument("--keep", type=int, default=90, help="SM version whose cubins stay (90: H100/H200)")
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args()
    print(strip(a.library, a.keep, a.dry_run))


if __name__ == "__main__":
    main()
