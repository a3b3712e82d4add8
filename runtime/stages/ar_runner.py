"""The AR runner: what the scheduler's AR worker calls to run the LM (nano-vllm's "model runner").

`ARRunner` is the protocol: KV slots, a batched prefill and a batched decode step returning last-position logits.
`TorchARRunner` runs the PyTorch `CosyVoice3LM`: it owns the static KV-cache slots (`KVSlots`), the CUDA-graph
ladders of the decode step and the prefill (`ar_graphs.py`), the torch.compile'd functions and their warm-up, and the
padding rows the compiled path needs. Another engine (TensorRT-LLM) implements the same protocol.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..models.sampling import PackedRows, StaticSampler, ids_to_host
from .kv_slots import KVSlots

KV_LEN_STEP = 256  # decode attends to the cache rounded up to this many positions
MIN_COMPILED_ROWS = 2  # compiled LM calls get >= 2 rows (padding rows -> scratch slot): dynamo specializes batch 1


@dataclass
class PrefillRow:
    slot: int
    embeds: torch.Tensor               # [T, H] LM input embeddings
    ids: torch.Tensor | None = None    # [T] the runner's own input ids (its `prompt_ids`), for engines that take ids


@runtime_checkable
class ARRunner(Protocol):
    """Runs the LM for the AR worker; owns the KV slots and any graphs / compiled functions."""

    max_batch: int  # KV slots
    max_len: int    # KV positions per slot

    def allocate(self) -> int | None: ...      # a free slot, or None

    # The prompt as this runner's input ids, one per LM input position (the scheduler passes them in
    # PrefillRow.ids), or None: the runner takes the embeddings only. Decode tokens and the returned logits' columns
    # are speech ids whatever the runner's own vocab is (the runner maps them).
    def prompt_ids(self, text_ids: torch.Tensor, prompt_speech_ids: torch.Tensor) -> torch.Tensor | None: ...

    def release(self, slot: int) -> None: ...

    def prefill(self, rows: list[PrefillRow]) -> torch.Tensor: ...   # last-position logits [B, V], float32

    def decode(self, tokens: list[int], slots: list[int], positions: list[int]) -> torch.Tensor: ...  # [B, V]

    def close(self) -> None: ...


def default_max_len(models) -> int:
    """KV positions per slot when not configured: prompt + output tokens are bounded by the flow / HiFT noise
    buffers (2 mel frames per token); the text adds some more."""
    hift = models.hift
    limit = min(models.flow.max_frames, getattr(hift, "max_frames", None) or hift.noise_frames)
    max_pos = getattr(models.config.llm.qwen, "max_position_embeddings", None) or 1 << 30
    return min(max_pos, -(-(limit // 2 + 512) // KV_LEN_STEP) * KV_LEN_STEP)


class TorchARRunner:
    """`ARRunner` over a PyTorch CosyVoice3LM.

    `cuda_graphs` (CUDA only): the decode step is captured per (batch bucket, KV-length rung) and the prefill per
    (rows, padded length); calls that fit replay a graph. `compile`: the prefill and decode step are torch.compile'd
    (before the capture) and compiled now, not under load."""

    def __init__(self, lm, max_batch: int, max_len: int, device, *, cuda_graphs: bool = True, compile: bool = False,
                 graph_batches=(1, 2, 4, 8, 16, 32, 64), prefill_graph_batches=(1, 2, 4, 8),
                 prefill_graph_lengths=(64, 128, 256, 384, 512), max_prefill_tokens: int = 4096,
                 graph_sampling: bool = False):
        self.lm = lm
        self.max_batch, self.max_len = max_batch, max_len
        self.device = torch.device(device)
        self.compiled = compile
        use_graphs = cuda_graphs and self.device.type == "cuda"
        self.slots = KVSlots(lm, max_batch, max_len, scratch=use_graphs or compile)
        self._decode, self._prefill = lm.decode, lm.prefill
        if compile:
            from .compiled import compiled_lm

            self._decode, self._prefill = compiled_lm(lm)
        self.decode_graphs = self.prefill_graphs = None
        self.invariance_check: dict | None = None
        # `graph_sampling` (or `enable_graph_sampling` later): the decode step's sampling can run here
        # (`decode_sampled`), in decode graphs that hold it on the GPU (`sampled_graphs`)
        self.graph_sampler: StaticSampler | None = None
        self.sampled_graphs = None
        # `enable_decode_steps(K)`: K decode steps per call (`decode_steps`), sampled on the device by `step_sampler`
        # (in multi-step decode graphs on CUDA)
        self.decode_steps_n = 1
        self.step_sampler: StaticSampler | None = None
        self.step_graphs = None
        self._step_graph_sets: dict[int, object] = {}  # steps -> its multi-step DecodeGraphs (kept when switched off)
        self._decode_graph_shape = None  # (batches, KV rungs) of the decode graphs
        if use_graphs:
            from .ar_graphs import DecodeGraphs, PrefillGraphs

            batches = [b for b in graph_batches if b < max_batch] + [max_batch]
            if compile:  # batch 1 runs in the batch-2 graph (one padding row): no batch-1 compile
                batches = sorted({max(b, MIN_COMPILED_ROWS) for b in batches})
            rungs, kv = [], KV_LEN_STEP
            while kv < max_len:
                rungs.append(kv)
                kv *= 2
            rungs.append(max_len)
            self._decode_graph_shape = (batches, rungs)
            if graph_sampling:  # one set, the sampler inside (a step that is not sampled here feeds it idle rows)
                self.enable_graph_sampling()
                self.decode_graphs = self.sampled_graphs
            else:
                self.decode_graphs = DecodeGraphs(self._decode, batches, rungs, self.slots.scratch_slot, self.device)
            rows = [b for b in prefill_graph_batches if b <= max_batch]
            if compile:
                rows = sorted({max(b, MIN_COMPILED_ROWS) for b in rows})
            self.prefill_graphs = PrefillGraphs(
                self._prefill, rows, [t for t in prefill_graph_lengths if t <= max_len], max_prefill_tokens,
                lm.config.qwen.hidden_size, lm.dtype, self.slots.scratch_slot, self.device)
        elif graph_sampling:
            self.enable_graph_sampling()
        if compile:
            self._warm_compiled()

    def _sampler(self) -> StaticSampler:
        return StaticSampler(self.lm.config.speech_vocab, self.lm.config.speech_token_size)

    def enable_decode_steps(self, steps: int) -> None:
        """Make `decode_steps` run `steps` decode steps per call (`ar_graphs.decode_steps`; with decode graphs, a set
        of multi-step graphs captured over the same KV slots and compiled step the first time a `steps` is asked
        for, kept for the next scheduler that asks for it again: TTS.reconfigure, a benchmark's A/B). `steps` <= 1:
        off (no call runs more than one step)."""
        steps = max(1, int(steps))
        self.decode_steps_n, self.step_graphs = steps, None
        if steps <= 1:
            return
        if self.step_sampler is None:
            self.step_sampler = self._sampler()
        if self._decode_graph_shape is not None:
            graphs = self._step_graph_sets.get(steps)
            if graphs is None:
                from .ar_graphs import DecodeGraphs

                batches, rungs = self._decode_graph_shape
                graphs = self._step_graph_sets[steps] = DecodeGraphs(
                    self._decode, batches, rungs, self.slots.scratch_slot, self.device, self.step_sampler, steps=steps)
            self.step_graphs = graphs

    def can_decode_steps(self, rows: int, need_kv: int) -> bool:
        """Does a `decode_steps` call of `rows` rows fit, the longest attending `need_kv` positions at its first
        step (its last step attends `decode_steps_n - 1` more)?"""
        last = need_kv + self.decode_steps_n - 1
        if self.decode_steps_n <= 1 or last > self.max_len:
            return False
        return self.step_graphs is None or self.step_graphs.fits(rows, last)

    def decode_steps(self, tokens: list[int], slots: list[int], positions: list[int],
                     packed: PackedRows) -> list[list[int]]:
        """`packed.steps` (= `decode_steps_n`) decode steps, each sampled with its block of `packed` (made by
        `pack_rows(..., steps=)` for rows that `step_sampler.fits_steps`) and fed back as the next step's tokens:
        the ids [steps][rows]. Check `can_decode_steps` first. In a multi-step graph on CUDA, else eagerly in the same
        fixed-shape ops (the path the CPU tests check)."""
        from .ar_graphs import decode_steps

        need = max(positions) + packed.steps
        self.slots.install()
        if self.step_graphs is not None:
            return self.step_graphs.run_steps(tokens, slots, positions, need, packed)
        kv_len = min(self.max_len, -(-need // KV_LEN_STEP) * KV_LEN_STEP)
        t, s, p = self._padded([tokens, slots, positions], [0, self.slots.scratch_slot, 0])
        rows = self.step_sampler.rows(packed, t.shape[0]).to(self.device)
        ids = decode_steps(lambda t_, s_, p_: self._decode(t_, s_, p_, kv_len=kv_len), self.step_sampler, t, s, p,
                           rows)
        return ids_to_host(ids[:, :len(tokens)])

    def enable_graph_sampling(self) -> None:
        """Make `decode_sampled` sample in the runner: the fixed-shape sampler and, with decode graphs, a second set
        of them with the sampler inside, captured now over the same KV slots and compiled step (no compile again: a
        scheduler with `ar_graph_sampling` can take over this runner, `TTS.reconfigure`). Idempotent."""
        if self.graph_sampler is not None:
            return
        sampler = self._sampler()
        if self._decode_graph_shape is not None:
            from .ar_graphs import DecodeGraphs

            batches, rungs = self._decode_graph_shape
            self.sampled_graphs = DecodeGraphs(self._decode, batches, rungs, self.slots.scratch_slot, self.device,
                                               sampler)
        self.graph_sampler = sampler

    # ---------------------------------------------------------------- ARRunner
    def allocate(self) -> int | None:
        return self.slots.allocate()

    def release(self, slot: int) -> None:
        self.slots.release(slot)

    def prompt_ids(self, text_ids, prompt_speech_ids) -> None:
        """None: the PyTorch LM takes the prompt as embeddings (PrefillRow.embeds)."""
        return None

    def prefill(self, rows: list[PrefillRow]) -> torch.Tensor:
        self.slots.install()
        lengths = [r.embeds.shape[0] for r in rows]
        lengths_t, slots = self._padded([lengths, [r.slot for r in rows]], [1, self.slots.scratch_slot])
        width, hidden = max(lengths), rows[0].embeds.shape[1]
        embeds = torch.zeros(lengths_t.shape[0], width, hidden, device=self.device, dtype=self.lm.dtype)
        for i, r in enumerate(rows):
            embeds[i, :lengths[i]] = r.embeds.to(self.lm.dtype)
        if self.prefill_graphs is not None and self.prefill_graphs.bucket(len(lengths_t), width) is not None:
            return self.prefill_graphs(embeds, lengths_t, slots)[:len(rows)]
        return self._prefill(embeds, lengths_t, slots)[:len(rows)]

    def decode(self, tokens: list[int], slots: list[int], positions: list[int]) -> torch.Tensor:
        self.slots.install()
        need = max(positions) + 1
        if self.decode_graphs is not None and self.decode_graphs.fits(len(tokens), need):
            return self.decode_graphs.run_host(tokens, slots, positions, need)
        kv_len = min(self.max_len, -(-need // KV_LEN_STEP) * KV_LEN_STEP)
        t, s, p = self._padded([tokens, slots, positions], [0, self.slots.scratch_slot, 0])
        return self._decode(t, s, p, kv_len=kv_len)[:len(tokens)]

    def decode_sampled(self, tokens: list[int], slots: list[int], positions: list[int],
                       packed: PackedRows) -> tuple[torch.Tensor, list[int] | None]:
        """`decode`, and the step's ids when its sampling can run here (`graph_sampler` fits the packed rows): in the
        decode graph on CUDA, else eagerly in the same fixed-shape ops (the path the CPU tests check). Returns
        (logits, ids), ids None when the caller samples from the logits (`select_packed` with the same packed rows)."""
        sampler, graphs, need = self.graph_sampler, self.sampled_graphs, max(positions) + 1
        if sampler is not None and sampler.fits(packed):
            if graphs is None:
                logits = self.decode(tokens, slots, positions)
                return logits, ids_to_host(sampler(logits, sampler.rows(packed, len(tokens)).to(logits.device)))
            if graphs.fits(len(tokens), need):
                self.slots.install()
                return graphs.run_sampled(tokens, slots, positions, need, packed)
        return self.decode(tokens, slots, positions), None

    def check_batch_invariance(self, rows: int = 64) -> dict:
        """On this device, with this runner's graphs / compiled functions: does a row's decode logits stay the same
        bits alone and as one of `rows` rows (another graph bucket)? A short random prompt is prefilled into a free
        slot, then the same step is decoded once alone and once repeated over `rows` rows (every row the same slot,
        position and token, so every row writes the same K/V). Logged as a warning when it does not hold; the
        result stays in `stats()["batch_invariance_check"]`. The scheduler runs it at start with
        SchedulerConfig.batch_invariant (a few forward passes)."""
        slot = self.allocate()
        if slot is None:
            return {"checked": False, "why": "no free KV slot"}
        try:
            g = torch.Generator().manual_seed(0)
            n = 12
            embeds = torch.randn(n, self.lm.config.qwen.hidden_size, generator=g).to(self.device, self.lm.dtype)
            with torch.inference_mode():
                self.prefill([PrefillRow(slot, embeds)])
                alone = self.decode([7], [slot], [n])[0].float().clone()
                rows = max(2, min(rows, self.max_batch))
                many = self.decode([7] * rows, [slot] * rows, [n] * rows)[0].float().clone()
            diff = float((alone - many).abs().max())
            out = {"checked": True, "rows": rows, "invariant": diff == 0.0, "max_abs_diff": diff}
        finally:
            self.release(slot)
        if not out["invariant"]:
            logging.getLogger(__name__).warning(
                "batch_invariant: on this device a row's decode logits differ by %.3g between 1 and %d rows: tokens "
                "may depend on the batch here", diff, rows)
        self.invariance_check = out
        return out

    def close(self) -> None:
        """Drop the graphs (their memory pools) and the KV cache references."""
        self.decode_graphs = self.prefill_graphs = self.sampled_graphs = self.step_graphs = None
        self._step_graph_sets = {}

    # ---------------------------------------------------------------- extras
    @property
    def free(self) -> int:
        return self.slots.free

    def stats(self) -> dict:
        return {"slots": self.slots.slots, "free_slots": self.slots.free, "max_len": self.max_len,
                "decode_graph_replays": self.decode_graphs.replays if self.decode_graphs else 0,
                "prefill_graph_replays": self.prefill_graphs.replays if self.prefill_graphs else 0,
                # decode steps sampled inside a decode graph (`ar_graph_sampling`; the second graph set when the
                # runner took it on later, else the one set)
                "sampled_graph_replays": self.sampled_graphs.sampled if self.sampled_graphs else 0,
                # multi-step decode graphs (`ar_decode_steps`): replays, each `decode_steps` steps
                "multi_step_graph_replays": self.step_graphs.replays if self.step_graphs else 0,
                "slot_allocations": self.slots.allocations,
                **({"batch_invariance_check": self.invariance_check} if self.invariance_check else {})}

    def _padded(self, values: list[list[int]], pad: list[int]) -> list[torch.Tensor]:
        """Per-row int columns as device tensors; a compiled LM gets padding rows (`pad`: their values; the slot
        column pads with the scratch slot) up to MIN_COMPILED_ROWS. On CUDA each goes up from pinned memory without
        a host sync."""
        extra = max(0, MIN_COMPILED_ROWS - len(values[0])) if self.compiled else 0
        if self.device.type == "cuda":
            return [torch.tensor(col + [p] * extra, pin_memory=True).to(self.device, non_blocking=True)
                    for col, p in zip(values, pad)]
        return [torch.tensor(col + [p] * extra, device=self.device) for col, p in zip(values, pad)]

    def _warm_compiled(self) -> None:
        """Compile now, not under load: run the compiled prefill (and, without decode graphs, the decode step at
        the smallest padded batch and one row more: the two decode specializations, see `llm.decode_attention`) into
        the scratch slot (decode graphs compile while they are captured)."""
        dev, n = self.device, MIN_COMPILED_ROWS
        with torch.inference_mode():  # as the AR worker's tensors are (dynamo guards on inference-ness)
            rows = torch.full((n,), self.slots.scratch_slot, device=dev)
            embeds = torch.zeros(n, 8, self.lm.config.qwen.hidden_size, device=dev, dtype=self.lm.dtype)
            self._prefill(embeds, torch.full((n,), 8, device=dev), rows)
            if self.decode_graphs is None:
                for b in (n, max(n, self.lm.reduce_attention_max_rows) + 1):  # the reduce-form rows and the SDPA rows
                    self._decode(torch.zeros(b, dtype=torch.long, device=dev),
                                 torch.full((b,), self.slots.scratch_slot, device=dev),
                                 torch.full((b,), 8, device=dev), kv_len=min(KV_LEN_STEP, self.max_len))
