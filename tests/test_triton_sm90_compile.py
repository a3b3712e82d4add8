"""The project's Triton kernels (the DiT's hop attention and conv, the LM's split-KV decode attention and batch-
invariant kernels) compile for the GPUs this project serves on (sm_90: H100 / H200) without a GPU:
`triton.compile` for a CUDA target runs Triton's whole pipeline (TTIR, TTGIR, LLVM IR, PTX, ptxas to a cubin) on the
CPU. The interpreter tests check what the kernels compute; these catch what only the compiler refuses (a construct
the interpreter runs but the code generator does not, a tile over the shared memory) before device time is spent,
and record each tile's shared memory. The full-size DiT's shapes: 64-channel heads, 50-frame chunks, 64-channel
conv groups, bf16. One subprocess without TRITON_INTERPRET (which the GPU-less test run sets, conftest.py, and under
which `triton.jit` makes interpreter functions). Skipped where Triton is not installed (the CPU torch wheel does not
bring it) or cannot build for CUDA."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="Triton is not installed (the CPU torch wheel does not bring it)")

SM90_SHARED = 227 * 1024  # an sm_90 block's shared memory at most
HOP_TILES = [(64, 64, 4), (64, 128, 4), (64, 128, 8), (128, 64, 8), (128, 128, 8)]
CONV_TILES = [64, 128]

COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cosytrt.runtime.models import dit_conv_triton, hop_attention

def build(kernel, types, constexprs, warps):
    sig = {n: ("constexpr" if n in constexprs else types.get(n, "i32")) for n in kernel.arg_names}
    try:
        out = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs),
                             target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        return {"shared": out.metadata.shared, "cubin": "cubin" in out.asm}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:2000]}

hop_types = {**dict.fromkeys(("Q", "KN", "VN", "SK", "SV", "O"), "*bf16"),
             **dict.fromkeys(("ROWS", "PLEN", "NVALID"), "*i64"), "scale": "fp32"}
res = {}
for bm, bn, w in json.loads(sys.argv[1]):
    res[f"hop {bm}x{bn}x{w}"] = build(hop_attention._kernel(), hop_types,
                                      {"HD": 64, "CHUNK": 50, "BLOCK_M": bm, "BLOCK_N": bn, "PREC": "tf32"}, w)
for bt in json.loads(sys.argv[2]):
    res[f"conv {bt}"] = build(dit_conv_triton._kernel(), dict.fromkeys(("X", "W", "BIAS", "Y"), "*bf16"),
                              {"K": 31, "CG": 64, "BT": bt, "HAS_BIAS": True, "PREC": "tf32"}, 4)
from cosytrt.runtime.models import bi_attention_triton, bi_norm_triton, decode_attention_triton as dat
split, merge = dat._kernels()
for indirect in (False, True):  # the LM's decode attention: 2 kv heads of 64, 7 query heads each (padded to 16)
    res[f"split_kv indirect={indirect}"] = build(split, {**dict.fromkeys(("Q", "K", "V"), "*bf16"),
                                                         **dict.fromkeys(("ROWS", "POS"), "*i64"),
                                                         **dict.fromkeys(("M", "L", "ACC"), "*fp32"), "scale": "fp32"},
                                                 {"HD": 64, "GP": dat.MIN_ROWS, "SPL": dat.SPLIT, "PREC": "tf32",
                                                  "INDIRECT": indirect}, 4)
res["split_kv merge"] = build(merge, {"POS": "*i64", **dict.fromkeys(("M", "L", "ACC"), "*fp32"), "O": "*bf16"},
                              {"HD": 64, "GP": dat.MIN_ROWS, "SPL": dat.SPLIT}, 4)
res["bi attention"] = build(bi_attention_triton._kernel(), {**dict.fromkeys(("Q", "K", "V", "O"), "*bf16"),
                                                             **dict.fromkeys(("QPOS", "KVLEN"), "*i64"),
                                                             "scale": "fp32"},
                            {"HD": 64, "GP": 8, "BLK": bi_attention_triton.BLOCK}, 4)
rms, silu = bi_norm_triton._kernels()
res["bi rms_norm"] = build(rms, {**dict.fromkeys(("X", "W", "Y"), "*bf16"), "eps": "fp32"}, {"BLOCK": 1024}, 4)
res["bi silu_mul"] = build(silu, dict.fromkeys(("G", "U", "Y"), "*bf16"), {"BLOCK": 1024}, 4)
print("RESULT " + json.dumps(res))
"""


@pytest.fixture(scope="module")
def built():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(HOP_TILES), json.dumps(CONV_TILES)], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"the compile subprocess failed: {proc.stderr[-3000:]}"
    res = json.loads(lines[-1][len("RESULT "):])
    errors = [r["error"] for r in res.values() if "error" in r]
    if errors and all(("ptxas" in e.lower() or "backend" in e.lower()) for e in errors):
        pytest.skip(f"Triton cannot build for CUDA here: {errors[0][:300]}")
    return res


@pytest.mark.parametrize("tiles", HOP_TILES)
def test_hop_attention_kernel_compiles_for_sm90(built, tiles):
    r = built["hop {}x{}x{}".format(*tiles)]
    assert "error" not in r, r.get("error")
    assert r["cubin"] and 0 < r["shared"] <= SM90_SHARED


@pytest.mark.parametrize("bt", CONV_TILES)
def test_dit_conv_kernel_compiles_for_sm90(built, bt):
    r = built[f"conv {bt}"]
    assert "error" not in r, r.get("error")
    assert r["cubin"] and r["shared"] <= SM90_SHARED


@pytest.mark.parametrize("name", ["split_kv indirect=False", "split_kv indirect=True", "split_kv merge",
                                  "bi attention", "bi rms_norm", "bi silu_mul"])
def test_lm_kernels_compile_for_sm90(built, name):
    r = built[name]
    assert "error" not in r, r.get("error")
    assert r["cubin"] and r["shared"] <= SM90_SHARED
