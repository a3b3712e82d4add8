"""The flow's Euler solve one step at a time, for rows that joined at different times.

`Flow.solve` runs all 10 Euler steps of a batch in one go, so a request whose first hop becomes ready waits for every
step of a long final already running. `FlowStepper` keeps each row's solver state (its noisy mel `x`, its time `t`,
its next step size `dt`) between calls and runs ONE estimator call for any set of rows, each at its own step (the DiT
takes one `t` per row): the DiT worker can then let a new first hop join the next step, like continuous batching of
LM decode steps.

Per row the arithmetic is exactly `Flow.solve`'s: the same noise columns, the same `t`/`dt` recurrence in the same
dtype, the same CFG combination and update `x + dt * v`; only the batch it shares each call with differs (rows are
independent: right padding is masked out of attention and the convolutions are causal).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from ..models.flow import Flow, FlowInput, FlowRow
from ...engines.errors import InputError


_serial = itertools.count(1)


@dataclass(eq=False)
class FlowSteps:
    """Solver state of one flow row: `x` [80, frames] after `step` of `n_steps` Euler steps."""
    row: FlowRow
    streaming: bool
    x: torch.Tensor
    t: torch.Tensor            # 0-d, the flow's dtype
    dt: torch.Tensor           # 0-d, the next step's size
    n_steps: int
    step: int = 0
    key: Any = field(default=None)
    serial: int = field(default_factory=lambda: next(_serial))

    @property
    def done(self) -> bool:
        return self.step >= self.n_steps

    def mel(self) -> torch.Tensor:
        """The row's output mel [1, 80, frames - prompt_frames] in float32 (once done)."""
        if not self.done:
            raise InputError(f"flow row is at step {self.step} of {self.n_steps}: no mel yet")
        return self.x[:, self.row.prompt_frames:self.row.frames].float().unsqueeze(0)


class FlowStepper:
    """Starts rows and advances any set of them (one streaming mode per call) by one Euler step."""

    def __init__(self, flow: Flow):
        self.flow = flow
        self._last = None  # (row serials, the collated inputs that stay fixed over their steps)

    @torch.inference_mode()
    def start(self, inp: FlowInput, streaming: bool, finalize: Optional[bool] = None, key=None) -> FlowSteps:
        f = self.flow
        fin = inp.finalize if finalize is None else finalize
        row = f.prepare_row(inp.token, inp.prompt_token, inp.prompt_feat, inp.embedding, fin, inp.ids_checked)
        dtype, device = row.mu.dtype, row.mu.device
        t_span = f.time_span(device, dtype)
        x = f.rand_noise[0, :, :row.frames].to(device=device, dtype=dtype).clone()
        return FlowSteps(row, streaming, x, t_span[0].clone(), (t_span[1] - t_span[0]).clone(), len(t_span) - 1,
                         key=key)

    @torch.inference_mode()
    def step(self, rows: Sequence[FlowSteps], estimator: Optional[Callable] = None) -> None:
        """One estimator call (CFG: 2B rows) advancing every row of `rows` by one step, in place."""
        if not rows:
            raise InputError("flow step has no rows")
        streaming = rows[0].streaming
        if any(r.streaming != streaming for r in rows):
            raise InputError("one flow step call takes rows of one attention mode (streaming or offline)")
        if any(r.done for r in rows):
            raise InputError("a flow row that finished its steps was stepped again")
        f = self.flow
        estimator = f.estimator if estimator is None else estimator
        B = len(rows)
        key = tuple(r.serial for r in rows)
        if self._last is not None and self._last[0] == key:  # the same rows as the last step: same fixed inputs
            mu, mask_in, mu_in, spks_in, cond_in = self._last[1]
        else:
            mu, mask, spks, cond = f.collate([r.row for r in rows])
            mask_in, mu_in = torch.cat((mask, mask)).to(mu.dtype), torch.cat((mu, torch.zeros_like(mu)))
            spks_in = torch.cat((spks, torch.zeros_like(spks))).to(mu.dtype)
            cond_in = torch.cat((cond, torch.zeros_like(cond))).to(mu.dtype)
            self._last = (key, (mu, mask_in, mu_in, spks_in, cond_in))
        T = mu.shape[2]
        x = mu.new_zeros(B, mu.shape[1], T)
        for i, r in enumerate(rows):
            x[i, :, :r.row.frames] = r.x
        t = torch.stack([r.t for r in rows])
        cfg_rate = f.cfg.inference_cfg_rate
        v = estimator(torch.cat((x, x)), mask_in, mu_in, torch.cat((t, t)), spks_in, cond_in, streaming=streaming)
        v_cond, v_uncond = torch.split(v, [B, B], dim=0)
        v = (1.0 + cfg_rate) * v_cond - cfg_rate * v_uncond
        t_span = None
        for i, r in enumerate(rows):
            n = r.row.frames
            r.x = r.x + r.dt * v[i, :, :n]
            r.t = r.t + r.dt
            r.step += 1
            if r.step < r.n_steps:
                if t_span is None:
                    t_span = f.time_span(mu.device, mu.dtype)
                r.dt = t_span[r.step + 1] - r.t
