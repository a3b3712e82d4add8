"""A fixed pool of static KV-cache slots for continuous batching on one CosyVoice3LM.

The cache is allocated once (`lm.setup_cache(slots, max_len)`); each running request owns one slot until it finishes
or is cancelled. The pool keeps its own references to the per-layer caches and re-installs them before every step, so
a single-request `generate` / `Pipeline.run` in between (which may replace the LM's cache) cannot corrupt it.
"""
from __future__ import annotations

from ...engines.errors import InputError


class KVSlots:
    def __init__(self, lm, slots: int, max_len: int, scratch: bool = False):
        """`scratch`: one extra slot (index `slots`) that is never handed out — padding rows of captured decode
        graphs (and of batch-1 calls of the compiled LM) write there.

        The cache holds one position more than `max_len`: reads of the longest KV length are then a strict slice of
        the buffer, not the whole of it (torch.compile specializes a whole-buffer slice: one compile fewer)."""
        if not isinstance(slots, int) or slots < 1:
            raise InputError(f"KVSlots: slots must be a positive int, got {slots!r}")
        lm.setup_cache(slots + (1 if scratch else 0), max_len + 1)
        self.scratch_slot = slots if scratch else None
        self.lm = lm
        self.slots = slots
        self.max_len = max_len
        layers = getattr(getattr(lm, "backbone", None), "layers", None) or []
        self._caches = [layer.self_attn.kv_cache for layer in layers]
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.allocations = 0

    def install(self) -> None:
        """Put this pool's caches back on the LM layers if someone replaced them."""
        if not self._caches:
            return
        for layer, cache in zip(self.lm.backbone.layers, self._caches):
            if layer.self_attn.kv_cache is not cache:
                layer.self_attn.kv_cache = cache

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.slots - len(self._free)

    def allocate(self) -> int | None:
        """A free slot index, or None when all are in use."""
        if not self._free:
            return None
        self.allocations += 1
        return self._free.pop()

    def release(self, slot: int) -> None:
        if not (0 <= slot < self.slots) or slot in self._free:
            raise InputError(f"KVSlots.release: slot {slot!r} is not in use")
        self._free.append(slot)
