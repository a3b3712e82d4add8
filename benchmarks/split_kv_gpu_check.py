"""The split-KV decode attention's kernels on a GPU (runtime/models/decode_attention_triton.py; CPU-tested only through
Triton's interpreter until now), at the full-size LM's decode shapes (2 kv heads x 7 query heads, head dim 64, bf16):
(1) values against the fp32 reference and the masked SDPA the LM uses by default, a row's bits alone against beside
other rows; (2) time per call (CUDA events over CUDA-graph replays, as the AR runner replays its step) of the kernel pair, the
masked SDPA (whatever backend torch picks for a boolean mask) and the compiled path's multiply-and-sum form (eager
here), at batch 1 / 16 / 64 and 256 / 1024 / 2048 keys. One layer's attention only: the LM's step runs 24 of them.
(3) the same from the slot cache as the decode step reads it: gathered rows then the kernels, against the kernels
reading each row in place (`rows=`), and the gathered rows under the masked SDPA.
  usage (device, repo root, after device_setup.sh --install): python3 benchmarks/split_kv_gpu_check.py > $OUT/x.md"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cosytrt.runtime.models import decode_attention_triton as dat

KVH, G, HD = 2, 7, 64


def case(b, n, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.float32).to(dtype)  # noqa: E731
    return mk(b, KVH, G, HD), mk(b, KVH, n, HD), mk(b, KVH, n, HD)


def masked_sdpa(q, k, v, pos):
    mask = (torch.arange(k.shape[2], device=k.device)[None, :] <= pos[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def sdpa_on(backend):
    """The masked SDPA with torch's choice narrowed to one backend (the decode step's default takes cuDNN's fused
    kernel on sm90, the heaviest kernel of the AR thread in run 60's profile)."""
    def run(q, k, v, pos):
        with sdpa_kernel([backend]):
            return masked_sdpa(q, k, v, pos)
    return run


def mul_sum(q, k, v, pos):
    mask = (torch.arange(k.shape[2], device=k.device)[None, :] <= pos[:, None])[:, None, None, :]
    scores = (q.float()[:, :, :, None, :] * k.float()[:, :, None, :, :]).sum(-1) * q.shape[-1] ** -0.5
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return (probs[..., None] * v.float()[:, :, None]).sum(-2).to(q.dtype)


def time_us(fn, iters=200):
    """µs per call of `fn` replayed from a CUDA graph of 20 calls (as the AR runner replays its step: no launch
    overhead), after warm-up on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(5):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters // 20):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / (iters // 20 * 20)


def slot_cache_table(slots: int = 64, max_len: int = 4096) -> bool:
    """The attention as the LM's decode step runs it, from the slot cache [slots, kvh, max_len, hd] (rows in
    arbitrary slots): gathering `cache[rows, :, :n]` then the kernels (before session 23: Inductor's gather copy,
    ~20 µs a layer in run 63's profile), the kernels reading each row in place (`rows=`, session 23), and the gather
    then the masked SDPA. Prints the table; returns whether in-place equals gathered bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(11)
    ck = torch.randn(slots, KVH, max_len, HD, generator=g, device="cuda").to(torch.bfloat16)
    cv = torch.randn(slots, KVH, max_len, HD, generator=g, device="cuda").to(torch.bfloat16)
    print("\n| batch | keys | gather + split-KV µs | split-KV in place µs | gather + masked SDPA µs | in place / gather "
          "| in place == gathered |")
    print("|---|---|---|---|---|---|---|")
    ok = True
    for b in (1, 16, 64):
        for n in (256, 1024, 2048):
            q = torch.randn(b, KVH, G, HD, generator=g, device="cuda").to(torch.bfloat16)
            rows = torch.randperm(slots, generator=g, device="cuda")[:b]
            pos = torch.full((b,), n - 1, device="cuda")
            gathered = lambda: dat.attention(q, ck[rows, :, :n], cv[rows, :, :n], pos)  # noqa: E731
            in_place = lambda: dat.attention(q, ck, cv, pos, rows=rows, n_keys=n)  # noqa: E731
            sdpa = lambda: masked_sdpa(q, ck[rows, :, :n], cv[rows, :, :n], pos)  # noqa: E731
            same = torch.equal(gathered(), in_place())
            ok &= same
            t = [time_us(f) for f in (gathered, in_place, sdpa)]
            print(f"| {b} | {n} | {t[0]:.1f} | {t[1]:.1f} | {t[2]:.1f} | {t[1] / t[0]:.2f} | {same} |")
    return ok


def main() -> int:
    print(f"# split-KV decode attention on {torch.cuda.get_device_name()} (torch {torch.__version__})\n")
    print("| dtype | batch | keys | max abs err vs fp32 reference | vs masked SDPA | row 0 alone == beside others |")
    print("|---|---|---|---|---|---|")
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        for b, n in ((1, 65), (5, 150), (16, 1024), (64, 2048)):
            q, k, v = case(b, n, dtype, seed=b + n)
            pos = torch.randint(0, n, (b,), device="cuda")
            pos[0] = n - 1
            out = dat.attention(q, k, v, pos)
            ref = dat.reference(q.float(), k.float(), v.float(), pos)
            err = (out.float() - ref).abs().max().item()
            err_sdpa = (out.float() - masked_sdpa(q, k, v, pos).float()).abs().max().item()
            alone = torch.equal(dat.attention(q[:1], k[:1], v[:1], pos[:1])[0], out[0])
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            ok &= err <= tol and alone
            print(f"| {str(dtype)[6:]} | {b} | {n} | {err:.2e} | {err_sdpa:.2e} | {alone} |")
    print("\n| batch | keys | split-KV kernels µs | masked SDPA µs | SDPA cuDNN only µs | SDPA memory-efficient only µs "
          "| multiply-and-sum (eager) µs | SDPA / split-KV |")
    print("|---|---|---|---|---|---|---|---|")
    for b in (1, 16, 64):
        for n in (256, 1024, 2048):
            q, k, v = case(b, n, torch.bfloat16)
            pos = torch.full((b,), n - 1, device="cuda")
            t = {}
            for name, fn in (("kv", dat.attention), ("sd", masked_sdpa), ("cd", sdpa_on(SDPBackend.CUDNN_ATTENTION)),
                             ("ef", sdpa_on(SDPBackend.EFFICIENT_ATTENTION)), ("ms", mul_sum)):
                try:
                    t[name] = time_us(lambda: fn(q, k, v, pos))
                except Exception as e:  # noqa: BLE001 - one failing form must not lose the table
                    print(f"{name} at batch {b}, {n} keys failed: {type(e).__name__}: {e}", file=sys.stderr)
                    t[name] = float("nan")
            print(f"| {b} | {n} | {t['kv']:.1f} | {t['sd']:.1f} | {t['cd']:.1f} | {t['ef']:.1f} | {t['ms']:.1f} "
                  f"| {t['sd'] / t['kv']:.2f} |")
    ok &= slot_cache_table()
    print(f"\nvalues within tolerance and row-invariant: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
