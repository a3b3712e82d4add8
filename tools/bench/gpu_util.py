"""The GPU's own busy share during a cell: `nvidia-smi` sampling `utilization.gpu` (the share of each sample period
in which any kernel ran on the device — coarse: one small kernel makes a period busy, so 100 % means "never idle",
not "every SM full") and `utilization.memory` every `period_ms`, in a child process, for as long as the cell runs.
It tells whether the GPU shared by the AR, DiT and HiFT threads is ever idle when a process saturates (BENCHMARKS.md
runs 40-41). Nothing is sampled without CUDA or without nvidia-smi on the PATH (summary n = 0)."""
from __future__ import annotations

import os
import shutil
import subprocess
import threading

from .playback import distribution


class GpuUtilProbe:
    def __init__(self, enabled: bool = True, period_ms: int = 100, device: str | None = None,
                 exe: str | None = None):
        self.exe = (exe or shutil.which("nvidia-smi")) if enabled else None
        self.period_ms = period_ms
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        self.device = device if device is not None else (visible or "0")
        self.gpu: list[float] = []
        self.mem: list[float] = []
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def _read(self, stream) -> None:
        for line in stream:
            try:
                gpu, mem = (float(x) for x in line.split(",")[:2])
            except ValueError:  # a header, "[N/A]" or a message: not a sample
                continue
            self.gpu.append(gpu)
            self.mem.append(mem)

    def __enter__(self) -> "GpuUtilProbe":
        if self.exe:
            try:
                self._proc = subprocess.Popen(
                    [self.exe, f"--id={self.device}", "--query-gpu=utilization.gpu,utilization.memory",
                     "--format=csv,noheader,nounits", f"--loop-ms={self.period_ms}"],
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            except OSError:
                self._proc = None
            else:
                self._reader = threading.Thread(target=self._read, args=(self._proc.stdout,), daemon=True,
                                                name="cosytrt-gpu-util")
                self._reader.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            if self._reader is not None:
                self._reader.join(timeout=5)
            self._proc = self._reader = None

    def summary(self) -> dict:
        """Utilisation in percent: the GPU's p50 / p95 / mean (and the memory controller's mean), samples n."""
        d = distribution(self.gpu)
        out = {"n": d["n"], "p50": d.get("p50"), "p95": d.get("p95"),
               "mean": round(sum(self.gpu) / len(self.gpu), 1) if self.gpu else None,
               "mem_mean": round(sum(self.mem) / len(self.mem), 1) if self.mem else None}
        return out
