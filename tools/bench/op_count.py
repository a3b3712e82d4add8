"""Counting the aten ops a piece of host code dispatches (each one a kernel launch on a GPU, and a release of the
interpreter lock that a busy server's other threads may take): `with OpCounter() as c: ...; c.total`, `c.ops` by
name; `active` pauses counting (e.g. around what a CUDA graph replay would run); `views=False` leaves out view ops
(no kernel)."""
from __future__ import annotations

import collections

from torch.utils._python_dispatch import TorchDispatchMode

VIEWS = frozenset({"slice", "select", "view", "unsqueeze", "squeeze", "as_strided", "alias", "_unsafe_view", "expand",
                   "t", "transpose", "detach", "detach_", "lift_fresh", "resolve_conj", "resolve_neg"})


class OpCounter(TorchDispatchMode):
    def __init__(self, views: bool = True):
        super().__init__()
        self.views = views
        self.active = True
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.active:
            name = func.overloadpacket.__name__
            if self.views or name not in VIEWS:
                self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())
