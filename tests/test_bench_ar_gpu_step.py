"""tools/bench/ar_gpu_step.py runs end to end on the tiny LM on the CPU (no graphs, no events, no kernels) and
renders its table; the bandwidth floor is known only for the cards it names. Its numbers are not checked."""
from __future__ import annotations

import torch

from cosytrt.tools.bench import ar_gpu_step


def test_tiny_cpu_run_and_table(one_torch_thread):
    res = ar_gpu_step.measure("tiny", "cpu", batches=(1, 2), positions=(40,), steps=2, dtype=torch.float32,
                              log=lambda *a: None)
    assert [(r["batch"], r["position"]) for r in res["rows"]] == [(1, 40), (2, 40)]
    assert all(r["replay_us"] > 0 and r["worker_us"] > 0 and r["floor_us"] is None for r in res["rows"])
    assert res["param_bytes"] > 0 and res["bandwidth"] is None
    text = ar_gpu_step.table(res)
    assert text.count("\n") == 3 and "| 2 | 40 |" in text


def test_bandwidth_by_card_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    assert ar_gpu_step.bandwidth(torch.device("cuda")) == 3.35e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A10")
    assert ar_gpu_step.bandwidth(torch.device("cuda")) is None
    assert ar_gpu_step.bandwidth(torch.device("cpu")) is None


def test_floor_bytes_leave_out_embedding_tables():
    m = torch.nn.Sequential(torch.nn.Embedding(100, 8), torch.nn.Linear(8, 4))
    assert ar_gpu_step.param_bytes(m) == (8 * 4 + 4) * 4
