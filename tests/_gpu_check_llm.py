"""Temporary GPU check (deleted after the run): CUDA-graph capture of prefill/decode and decode timing."""
import os, sys, time
import torch
from cosytrt.runtime.config import config_from_golden_json, full_config
from cosytrt.runtime.llm import CosyVoice3LM

dev = "cuda"
G = "tests/data/golden"
lm = CosyVoice3LM(config_from_golden_json(f"{G}/config.json").llm).eval()
lm.load_checkpoint(f"{G}/llm.pt")
lm = lm.to(dev)
torch.manual_seed(0)
B, T, S = 3, 40, 128
lm.setup_cache(4, S)
embeds = torch.randn(B, T, 64, device=dev)
lens = torch.tensor([40, 25, 9], device=dev)
slots = torch.tensor([2, 0, 3], device=dev)
tok = torch.randint(0, 6561, (B,), device=dev)
with torch.inference_mode():
    ref_p = lm.prefill(embeds, lens, slots)
    ref_d = lm.decode(tok, slots, lens, kv_len=64)
    # capture prefill + decode
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            lm.prefill(embeds, lens, slots); lm.decode(tok, slots, lens, kv_len=64)
    torch.cuda.current_stream().wait_stream(s)
    gp, gd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(gp):
        out_p = lm.prefill(embeds, lens, slots)
    with torch.cuda.graph(gd):
        out_d = lm.decode(tok, slots, lens, kv_len=64)
    gp.replay(); gd.replay(); torch.cuda.synchronize()
    print("prefill graph err", (out_p - ref_p).abs().max().item(), "decode graph err", (out_d - ref_d).abs().max().item())
    # full-size random weights, bf16: decode step time under a CUDA graph
    big = CosyVoice3LM(full_config().llm).to(dev, torch.bfloat16).eval()
    for b in (1, 16, 64):
        big.setup_cache(64, 2048)
        sl = torch.arange(b, device=dev); pos = torch.full((b,), 500, device=dev); tk = torch.randint(0, 6561, (b,), device=dev)
        for kv in (1024, 2048):
            s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3): big.decode(tk, sl, pos, kv_len=kv)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                o = big.decode(tk, sl, pos, kv_len=kv)
            for _ in range(5): g.replay()
            torch.cuda.synchronize(); t = time.perf_counter()
            for _ in range(50): g.replay()
            torch.cuda.synchronize()
            print(f"full bf16 decode B={b} kv_len={kv}: {(time.perf_counter()-t)/50*1e3:.3f} ms/step")
        e = torch.randn(b, 300, 896, device=dev, dtype=torch.bfloat16); L = torch.full((b,), 300, device=dev)
        big.prefill(e, L, sl); torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(5): big.prefill(e, L, sl)
        torch.cuda.synchronize(); print(f"full bf16 eager prefill B={b} T=300: {(time.perf_counter()-t)/5*1e3:.2f} ms")
