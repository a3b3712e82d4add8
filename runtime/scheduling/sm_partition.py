"""An SM partition for the DiT and the vocoder (`SchedulerConfig.dit_green_reserve_sms`): a CUDA green context
holding all but N of the device's SMs, and streams of it for the DiT and HiFT threads, so the AR's small decode
kernels (on an ordinary stream, free to use every SM) never wait for SMs that the DiT's and the vocoder's large
kernels hold. benchmarks/green_ctx_probe.py measures the effect on an AR-sized step beside a DiT-sized load.

torch's green-context API (beta) changed between releases; this uses `GreenContext.create(num_sms=..., device_id=...)`
and `.Stream()` (a stream made by cuGreenCtxStreamCreate, whose kernels run on the context's SMs). A torch without
`.Stream()` is refused with the reason: its `set_context` switches the calling thread's current stream, which the
scheduler's threads cannot share.

A partition lives as long as the process, and a later scheduler asking for the same one gets it again: the caching
allocator keeps blocks allocated on its streams (and the memory pools of graphs captured there) after the scheduler
that used them closes, and freeing them records events on those streams — on a destroyed context that aborted the
process (BENCHMARKS.md run 68: "CUDA error: context is destroyed" when the next scheduler recaptured the graphs)."""
from __future__ import annotations

import threading

import torch

from ...engines.cuda_graphs import indexed_device
from ...engines.errors import InputError


_PARTITIONS: dict[tuple[int, int, bool], "GreenPartition"] = {}  # (device index, reserve, own_hift): never freed
_LOCK = threading.Lock()


class GreenPartition:
    """The green context and its streams (kept alive together: the streams belong to the context): `dit`, the DiT
    thread's, and `hift`, the vocoder thread's (the DiT's own when the vocoder shares it)."""

    def __init__(self, ctx, streams: list, sms: int, total_sms: int):
        self.ctx, self.streams, self.sms, self.total_sms = ctx, streams, sms, total_sms
        self.dit, self.hift = streams[0], streams[-1]

    def close(self) -> None:
        """Wait for the streams' work (a scheduler's close). The context and its streams stay: see the module's
        docstring."""
        for s in self.streams:
            s.synchronize()


def green_streams(device, reserve_sms: int, own_hift: bool) -> GreenPartition:
    """The green context of (the device's SMs - `reserve_sms`) SMs on CUDA `device` with a stream for the DiT and,
    with `own_hift` (SchedulerConfig.hift_own_stream), another for the vocoder: made on the first call for these
    arguments, the same object on later ones. Raises InputError when it cannot be made (no CUDA, a reserve that
    leaves no SM to either side, a torch without the API)."""
    if torch.device(device).type != "cuda":
        raise InputError("dit_green_reserve_sms needs a CUDA device")
    index = indexed_device(device).index
    total = torch.cuda.get_device_properties(index).multi_processor_count
    if not 0 < reserve_sms < total:
        raise InputError(f"dit_green_reserve_sms must leave SMs to both sides: 0 < {reserve_sms} < {total} "
                         "(the device's SMs)")
    try:
        from torch.cuda.green_contexts import GreenContext
    except Exception as e:  # noqa: BLE001 - an older torch, a build without it
        raise InputError(f"dit_green_reserve_sms needs torch.cuda.green_contexts ({type(e).__name__}: {e})") from e
    if not hasattr(GreenContext, "Stream"):
        raise InputError(f"dit_green_reserve_sms: this torch ({torch.__version__}) has green contexts without "
                         "Stream(); its set_context switches the calling thread's stream instead")
    key = (index, reserve_sms, bool(own_hift))
    with _LOCK:
        part = _PARTITIONS.get(key)
        if part is None:
            try:
                ctx = GreenContext.create(num_sms=total - reserve_sms, device_id=index)
                streams = [ctx.Stream() for _ in range(2 if own_hift else 1)]
            except Exception as e:  # noqa: BLE001 - the driver: CUDA < 12.8, an SM count it cannot split
                raise InputError(f"dit_green_reserve_sms={reserve_sms}: no green context "
                                 f"({type(e).__name__}: {e})") from e
            part = _PARTITIONS[key] = GreenPartition(ctx, streams, total - reserve_sms, total)
    return part
