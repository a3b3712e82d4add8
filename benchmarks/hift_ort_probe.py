"""Where does the fp32 HiFT ONNX Runtime engine leave the eager model? (issue #22: CUDA EP fails HiFT parity at t512.)

Exports the full-size HiFT (the `--model random-full` weights, built on the CPU so CPU and CUDA runs share them) with
its intermediate tensors as extra outputs, runs that graph through ONNX Runtime (CPU EP, and the CUDA EP under
several option sets when available) and the eager model (CPU and CUDA), and prints the max |error| of every
intermediate against eager CPU (the upstream-matching reference) and against eager on the same device:

  f0       [B, T]       f0 predictor output (float64 in the graph, rounded to float32)
  arg      [B, T, 9]    the sine argument: float32(cum phase) * 2 * pi * 480 (~1e5 rad at t512)
  sine     [B, T, 9]    sin(arg) * nsf_alpha
  source   [B, 1, S]    the merged source signal
  wav      [B, S]       output (fp32 parity bound: 2e-3)
  decode   [B, S]       the conv stack alone: a second graph run on the *eager CPU* source (sine path excluded)

"[phase mod 2pi]" rows: the same graph with the sine argument reduced modulo 2 pi in float64 before the sine
(`HiFTOnnxGraph(reduce_phase=True)`): whether the CUDA EP's float32 sin of ~1e5 rad arguments is the error.
"[... + STFT/iSTFT MatMul]" rows: also `stft_matmul=True` (no strided Conv / ConvTranspose for the STFT / iSTFT).

One line per (runner, tensor). Runs in ~1-3 min on an H200; on a 2-core CPU (CPU EP only) ~2 min for t512.

--ops: every distinct Conv / ConvTranspose call of the eager model at those shapes (captured from one eager run) as a
one-op ONNX graph through ONNX Runtime with the runtime's provider plan (CUDA EP, tf32 off), against float64: the
relative error (max |err| / max |ref|) is ~1e-7 in fp32 and ~1e-4..1e-3 where cuDNN runs the op on TF32 tensor cores.
(ORT's cuDNN-frontend Conv / ConvTranspose retry a shape with tensor cores allowed when no non-tensor-core plan
supports it, use_tf32=0 or not: a shape-dependent fallback; this flags the shapes where that happens.)

  PYTHONPATH=.shim python benchmarks/hift_ort_probe.py --frames 256 512 --batch 2 [--ops] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import torch
import torch.nn as nn

NAMES = ["f0", "arg", "sine", "source", "wav"]


class ProbeGraph(nn.Module):
    """HiFTOnnxGraph (finalize) with the intermediates as outputs."""

    def __init__(self, hift, reduce_phase: bool = False, stft_matmul: bool = False):
        super().__init__()
        from cosytrt.build.export_hift import _with_matmul_stft, matmul_f0_predictor

        self.hift = _with_matmul_stft(hift) if stft_matmul else hift
        self.f0_predictor = matmul_f0_predictor(hift.f0_predictor)
        self.reduce_phase = reduce_phase

    def forward(self, mel, sine_noise):
        h = self.hift
        f0 = self.f0_predictor(mel, finalize=True).float()
        cum = h.cumulative_phase(f0)
        arg = cum.float() * 2 * math.pi * h.samples_per_frame
        r = torch.remainder(arg.double(), 2 * math.pi).float() if self.reduce_phase else arg
        sine = torch.sin(r) * h.cfg.nsf_alpha
        source = h.source_from_phase(f0, cum, sine_noise[:, :f0.shape[1] * h.samples_per_frame], self.reduce_phase)
        return h.decode(mel, source, True), f0, arg, sine, source


class DecodeGraph(nn.Module):
    def __init__(self, hift):
        super().__init__()
        self.hift = hift

    def forward(self, mel, source):
        return self.hift.decode(mel, source, True)


def eager(h, mel, noise):
    with torch.no_grad():
        f0 = h.predict_f0(mel)
        cum = h.cumulative_phase(f0)
        arg = cum.float() * 2 * math.pi * h.samples_per_frame
        sine = torch.sin(arg) * h.cfg.nsf_alpha
        source = h.source_from_phase(f0, cum, noise)
        wav = h.decode(mel, source, True)
        return {"f0": f0, "arg": arg, "sine": sine, "source": source, "wav": wav}


def export(module, inputs, names, out_names, path):
    axes = {n: {0: "batch", (1 if n == "sine_noise" else 2): "t"} for n in names}
    with torch.no_grad():
        torch.onnx.export(module, inputs, path, dynamo=False, opset_version=18, input_names=names,
                          output_names=out_names, dynamic_axes=axes)
    return path


def sessions(path, want_cuda: bool, only_default: bool = False, tag: str = ""):
    """(label, InferenceSession) per option set: the runtime's own provider plan and session options."""
    import onnxruntime as ort

    from cosytrt.engines.onnxruntime import OrtOptions, provider_plan, session_options

    out = [("ort-cpu" + tag, ort.InferenceSession(path, session_options(), providers=["CPUExecutionProvider"]))]
    if want_cuda and "CUDAExecutionProvider" in ort.get_available_providers():
        variants = [("ort-cuda (runtime default: EXHAUSTIVE, tf32 off)", OrtOptions(tensorrt=False), "all"),
                    ("ort-cuda HEURISTIC", OrtOptions(tensorrt=False, cudnn_conv_algo_search="HEURISTIC"), "all"),
                    ("ort-cuda DEFAULT algo", OrtOptions(tensorrt=False, cudnn_conv_algo_search="DEFAULT"), "all"),
                    ("ort-cuda graph_optimization=basic", OrtOptions(tensorrt=False), "basic"),
                    ("ort-cuda tf32 ON", OrtOptions(tensorrt=False, tf32=True), "all")]
        variants = variants[:1] if only_default else variants
        for label, opts, level in variants:
            plan, _ = provider_plan("cuda", ort.get_available_providers(), False, options=opts)
            so = session_options(graph_optimization=level)
            out.append((label + tag, ort.InferenceSession(path, so, providers=plan)))
    return out


def conv_calls(h, mel, noise) -> list[dict]:
    """Distinct F.conv1d / F.conv_transpose1d calls (op, input, weight, bias, kwargs) of one eager HiFT run."""
    import torch.nn.functional as F

    calls, seen = [], set()
    orig = {"conv1d": F.conv1d, "conv_transpose1d": F.conv_transpose1d}

    def wrap(op):
        def f(x, w, b=None, *a, **k):
            names = ["stride", "padding", "dilation", "groups"] if op == "conv1d" else \
                ["stride", "padding", "output_padding", "groups", "dilation"]
            kw = dict(zip(names, a), **k)
            key = (op, tuple(x.shape), tuple(w.shape), b is not None, str(sorted(kw.items())))
            if key not in seen and x.dtype == torch.float32:
                seen.add(key)
                calls.append({"op": op, "x": x.detach().clone(), "w": w.detach().clone(),
                              "b": None if b is None else b.detach().clone(), "kw": kw})
            return orig[op](x, w, b, *a, **k)
        return f

    F.conv1d, F.conv_transpose1d = wrap("conv1d"), wrap("conv_transpose1d")
    try:
        eager(h, mel, noise)
    finally:
        F.conv1d, F.conv_transpose1d = orig["conv1d"], orig["conv_transpose1d"]
    return calls


class OneConv(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.op, self.kw = c["op"], c["kw"]
        self.register_buffer("w", c["w"])
        self.register_buffer("b", c["b"] if c["b"] is not None else torch.zeros(0))

    def forward(self, x):
        import torch.nn.functional as F

        b = self.b if self.b.numel() else None
        return (F.conv1d if self.op == "conv1d" else F.conv_transpose1d)(x, self.w, b, **self.kw)


def op_probe(h, mel, noise, cuda: bool, tmp: str) -> list[dict]:
    """Per distinct conv call: relative error of ORT (CPU EP, and CUDA EP with the runtime's options) vs float64."""
    import onnxruntime as ort

    from cosytrt.engines.onnxruntime import OrtOptions, provider_plan, session_options

    plans = [("cpu", ["CPUExecutionProvider"])]
    if cuda and "CUDAExecutionProvider" in ort.get_available_providers():
        for name, tf32 in (("cuda", False), ("cuda_tf32_on", True)):
            plans.append((name, provider_plan("cuda", ort.get_available_providers(), False,
                                              options=OrtOptions(tensorrt=False, tf32=tf32))[0]))
    out = []
    for i, c in enumerate(conv_calls(h, mel, noise)):
        m = OneConv(c).eval()
        path = os.path.join(tmp, f"op{i}.onnx")
        with torch.no_grad():
            torch.onnx.export(m, (c["x"],), path, dynamo=False, opset_version=18, input_names=["x"],
                              output_names=["y"])
            ref = OneConv({**c, "w": c["w"].double(), "b": None if c["b"] is None else c["b"].double()})(
                c["x"].double())
        peak = float(ref.abs().max()) or 1.0
        row = {"op": c["op"], "x": list(c["x"].shape), "w": list(c["w"].shape),
               "kw": {k: (list(v) if isinstance(v, tuple) else v) for k, v in c["kw"].items()}}
        for name, plan in plans:
            s = ort.InferenceSession(path, session_options(), providers=plan)
            y = torch.from_numpy(s.run(None, {"x": c["x"].numpy()})[0]).double()
            row[f"rel_err_{name}"] = float((y - ref).abs().max()) / peak
        out.append(row)
        flag = "  <-- TF32-like" if row.get("rel_err_cuda", 0) > 1e-5 else ""
        errs = " ".join(f"{k} {v:.2e}" for k, v in row.items() if k.startswith("rel_err"))
        print(f"  {c['op']:16s} x{row['x']} w{row['w']} {row['kw']}: {errs}{flag}", flush=True)
    return out


def max_abs(a, b):
    a, b = torch.as_tensor(a).double().cpu(), torch.as_tensor(b).double().cpu()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--frames", type=int, nargs="+", default=[256, 512])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write results.json here")
    p.add_argument("--no-cuda", action="store_true")
    p.add_argument("--ops", action="store_true", help="also check every conv shape alone (see the top)")
    p.add_argument("--ops-only", action="store_true", help="only the per-conv check")
    args = p.parse_args(argv)
    import copy

    import numpy as np

    from cosytrt.build.parity_cases import hift_case_mels
    from cosytrt.tools.build_cmd import random_full_models

    cuda = torch.cuda.is_available() and not args.no_cuda
    if cuda:
        torch.backends.cudnn.allow_tf32 = False  # as the parity checker's Pipeline sets it
    t0 = time.time()
    h_cpu = random_full_models("cpu").hift
    h_gpu = copy.deepcopy(h_cpu).to("cuda").eval() if cuda else None
    tmp = tempfile.mkdtemp(prefix="hift_probe_")
    probe_s, dec_s = [], {}
    if not args.ops_only:
        mel0, noise0 = torch.randn(2, 80, 64) - 4, h_cpu.sine_waves[:, :64 * 480].clone()
        probe = export(ProbeGraph(h_cpu).eval(), (mel0, noise0), ["mel", "sine_noise"], ["wav"] + NAMES[:-1],
                       os.path.join(tmp, "probe.onnx"))
        reduced = export(ProbeGraph(h_cpu, True).eval(), (mel0, noise0), ["mel", "sine_noise"], ["wav"] + NAMES[:-1],
                         os.path.join(tmp, "probe_reduced.onnx"))
        matmul = export(ProbeGraph(h_cpu, True, True).eval(), (mel0, noise0), ["mel", "sine_noise"],
                        ["wav"] + NAMES[:-1], os.path.join(tmp, "probe_matmul.onnx"))
        src0 = h_cpu.sine_source(h_cpu.predict_f0(mel0))
        dec = export(DecodeGraph(h_cpu).eval(), (mel0, src0), ["mel", "source"], ["wav"],
                     os.path.join(tmp, "decode.onnx"))
        print(f"exported in {time.time() - t0:.0f} s; fp32 wav bound 2e-3", flush=True)
        probe_s, dec_s = sessions(probe, cuda), dict(sessions(dec, cuda))
        probe_s += sessions(reduced, cuda, only_default=True, tag=" [phase mod 2pi]")
        probe_s += sessions(matmul, cuda, only_default=True, tag=" [phase mod 2pi + STFT/iSTFT MatMul]")
    results = []
    for T in args.frames:
        mel = torch.stack(hift_case_mels(h_cpu, [T] * args.batch, args.seed + 101 + 7 * T + args.batch))
        noise = h_cpu.noise_slice(0, T)
        if args.ops or args.ops_only:
            print(f"t{T} b{args.batch}: every conv shape alone, relative error vs float64", flush=True)
            for r in op_probe(h_cpu, mel, noise, cuda, tmp):
                results.append({"frames": T, "batch": args.batch, "kind": "op", **r})
            if args.ops_only:
                continue
        ref = eager(h_cpu, mel, noise)
        rows = {"eager-cpu": ref}
        if cuda:
            g = eager(h_gpu, mel.cuda(), noise.cuda())
            rows["eager-cuda"] = {k: v.cpu() for k, v in g.items()}
        feed = {"mel": mel.numpy(), "sine_noise": np.ascontiguousarray(noise.numpy())}
        dfeed = {"mel": mel.numpy(), "source": ref["source"].numpy()}
        for label, s in probe_s:
            o = s.run(None, feed)
            rows[label] = dict(zip(["wav"] + NAMES[:-1], [torch.from_numpy(x) for x in o]))
            if label in dec_s:
                rows[label]["decode"] = torch.from_numpy(dec_s[label].run(None, dfeed)[0])
        ref = dict(ref, decode=ref["wav"])
        for label, r in rows.items():
            if label == "eager-cpu":
                continue
            same_dev = rows.get("eager-cuda") if "cuda" in label and label != "eager-cuda" else None
            for k in NAMES + ["decode"]:
                if k not in r:
                    continue
                e_cpu = max_abs(r[k], ref[k])
                e_dev = max_abs(r[k], same_dev["wav" if k == "decode" else k]) if same_dev else None
                n_diff = int((torch.as_tensor(r[k]).cpu() != torch.as_tensor(ref[k]).cpu()).sum())
                results.append({"frames": T, "batch": args.batch, "runner": label, "tensor": k,
                                "max_abs_vs_eager_cpu": e_cpu, "max_abs_vs_eager_cuda": e_dev,
                                "elements_differing_vs_eager_cpu": n_diff})
                extra = f"  vs eager-cuda {e_dev:.3e}" if e_dev is not None else ""
                print(f"t{T} b{args.batch} {label:45s} {k:7s} vs eager-cpu {e_cpu:.3e} ({n_diff} differ){extra}",
                      flush=True)
        print(f"  arg max {float(ref['arg'].abs().max()):.4g} rad, wav peak {float(ref['wav'].abs().max()):.3g}",
              flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "hift_ort_probe.json"), "w") as f:
            json.dump({"torch": torch.__version__, "results": results}, f, indent=1)
    print(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
