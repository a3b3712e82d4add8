"""`trtbuild golden DIR`: recompute every golden vector with cosytrt's eager models and compare.

DIR has the layout of the upstream golden directory: `llm.pt`, `flow.pt`, `hift.pt`, `config.json`,
`vectors.safetensors` and optionally `stream_vectors.safetensors`. Works for any seed or size of that layout.
"""
from __future__ import annotations

import json
import os

import torch

from ..engines.errors import ModelDirError
from .table import format_table

# max |error| bounds from the golden README; streaming is judged by SNR (dB, higher is better)
TOLERANCES = {
    "llm.hidden": 1e-4, "llm.logits": 1e-4,
    "flow.offline.mel": 1e-3, "flow.stream.mel": 1e-3, "flow.stream_final.mel": 1e-3,
    "hift.final.wav": 2e-3, "hift.final.source": 5e-4, "hift.chunk.wav": 2e-3, "hift.chunk.source": 5e-4,
}
STREAM_MIN_SNR_DB = 40.0


def snr_db(reference: torch.Tensor, estimate: torch.Tensor) -> float:
    ref = reference.double().flatten()
    err = ref - estimate.double().flatten()
    noise = float((err * err).sum())
    if noise == 0:
        return float("inf")
    return 10.0 * float(torch.log10((ref * ref).sum() / noise))


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).abs().max())


def compute_golden(golden_dir: str) -> dict:
    """Return {vector: max_abs_error, ...} plus the streaming SNRs and `pass`."""
    from ..runtime.models.loading import load_models

    if not os.path.isdir(golden_dir):
        raise ModelDirError(f"golden directory not found: {golden_dir!r}")
    vpath = os.path.join(golden_dir, "vectors.safetensors")
    if not os.path.isfile(vpath):
        raise ModelDirError(f"golden directory {golden_dir!r} lacks vectors.safetensors")
    v = _load_vectors(vpath, VECTOR_KEYS)
    spath = os.path.join(golden_dir, "stream_vectors.safetensors")
    sv = _load_vectors(spath, STREAM_KEYS) if os.path.isfile(spath) else None
    if sv is not None:  # and one wav per chunk
        _require(spath, sv, [f"stream.chunk{i}.wav" for i in range(sv["stream.chunk_lengths"].numel())])
    m = load_models(golden_dir)
    try:
        res = _compare(m, v, sv)
    except (RuntimeError, ValueError, IndexError) as e:  # vectors of another size than the golden models
        raise ModelDirError(f"golden directory {golden_dir!r}: its vectors do not fit its models "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    ok = all(res[k] <= tol for k, tol in TOLERANCES.items())
    if "stream.lengths_match" in res:
        ok = ok and res["stream.lengths_match"] and all(
            val >= STREAM_MIN_SNR_DB for k, val in res.items() if k.endswith(".snr_db"))
    res["pass"] = bool(ok)
    return res


VECTOR_KEYS = ("llm.lm_input", "llm.hidden", "llm.logits", "flow.rand_noise", "flow.token", "flow.prompt_token",
               "flow.prompt_feat", "flow.embedding", "flow.offline.mel", "flow.stream.mel", "flow.stream_final.mel",
               "hift.rand_ini", "hift.sine_waves", "hift.uv", "hift.mel", "hift.final.wav", "hift.final.source",
               "hift.chunk.wav", "hift.chunk.source")
STREAM_KEYS = ("stream.rand_noise", "stream.rand_ini", "stream.sine_waves", "stream.token", "stream.prompt_token",
               "stream.prompt_feat", "stream.embedding", "stream.chunk_lengths", "stream.wav")


def _load_vectors(path: str, keys: tuple[str, ...]) -> dict:
    """A golden safetensors file with every key the check reads (ModelDirError naming the file otherwise)."""
    from safetensors.torch import load_file

    try:
        v = load_file(path)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types on a damaged file
        raise ModelDirError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    _require(path, v, keys)
    return v


def _require(path: str, v: dict, keys) -> None:
    missing = [k for k in keys if k not in v]
    if missing:
        raise ModelDirError(f"{path}: lacks golden vector(s) {', '.join(missing)}")


def _compare(m, v: dict, sv: dict | None) -> dict:
    res: dict = {}
    with torch.inference_mode():
        hidden = m.llm.forward_hidden(v["llm.lm_input"])
        res["llm.hidden"] = _max_err(hidden, v["llm.hidden"])
        res["llm.logits"] = _max_err(m.llm.logits(hidden), v["llm.logits"])

        m.flow.set_noise(v["flow.rand_noise"])
        args = (v["flow.token"], v["flow.prompt_token"], v["flow.prompt_feat"], v["flow.embedding"])
        for name, streaming, finalize in (("offline", False, True), ("stream", True, False),
                                          ("stream_final", True, True)):
            mel = m.flow.inference(*args, streaming=streaming, finalize=finalize)
            res[f"flow.{name}.mel"] = _max_err(mel, v[f"flow.{name}.mel"])

        m.hift.set_noise(rand_ini=v["hift.rand_ini"], sine_waves=v["hift.sine_waves"], uv=v["hift.uv"])
        for name, finalize in (("final", True), ("chunk", False)):
            wav, src = m.hift.inference(v["hift.mel"], finalize=finalize)
            res[f"hift.{name}.wav"] = _max_err(wav, v[f"hift.{name}.wav"])
            res[f"hift.{name}.source"] = _max_err(src, v[f"hift.{name}.source"])

        if sv is not None:
            res.update(_stream_check(m, sv))
    return res


def _stream_check(m, s: dict) -> dict:
    from ..runtime.stages.token2wav import Token2Wav

    m.flow.set_noise(s["stream.rand_noise"])
    m.hift.set_noise(rand_ini=s["stream.rand_ini"], sine_waves=s["stream.sine_waves"])
    t2w = Token2Wav(m.flow, m.hift)
    tokens = s["stream.token"][0]
    chunks = list(t2w.stream_all(tokens, s["stream.prompt_token"][0], s["stream.prompt_feat"][0],
                                 s["stream.embedding"][0]))
    lengths = [int(c.shape[-1]) for c in chunks]
    golden_lengths = [int(x) for x in s["stream.chunk_lengths"].tolist()]
    out: dict = {"stream.lengths_match": lengths == golden_lengths}
    for i in range(len(golden_lengths)):
        ref = s[f"stream.chunk{i}.wav"]
        out[f"stream.chunk{i}.snr_db"] = (snr_db(ref, chunks[i].reshape(ref.shape))
                                          if i < len(chunks) and chunks[i].numel() == ref.numel() else float("-inf"))
    wav = torch.cat([c.reshape(1, -1) for c in chunks], dim=1) if chunks else torch.zeros(1, 0)
    out["stream.wav.snr_db"] = (snr_db(s["stream.wav"], wav) if wav.shape == s["stream.wav"].shape
                                else float("-inf"))
    return out


def add_arguments(p) -> None:
    p.add_argument("dir", help="golden directory (llm.pt, flow.pt, hift.pt, config.json, vectors.safetensors)")
    p.add_argument("--json", action="store_true", help="print one JSON object {vector: max_abs_error, ..., pass}")


def run(args) -> int:
    res = compute_golden(args.dir)
    if args.json:
        print(json.dumps(res))
    else:
        rows = []
        for k, tol in TOLERANCES.items():
            rows.append([k, "max |err|", res[k], tol, "ok" if res[k] <= tol else "FAIL"])
        for k, val in res.items():
            if k.endswith(".snr_db"):
                rows.append([k, "SNR dB", val, f">= {STREAM_MIN_SNR_DB}", "ok" if val >= STREAM_MIN_SNR_DB else "FAIL"])
        if "stream.lengths_match" in res:
            rows.append(["stream.lengths_match", "exact", res["stream.lengths_match"], True,
                         "ok" if res["stream.lengths_match"] else "FAIL"])
        print(format_table(["vector", "metric", "value", "bound", "result"], rows,
                           title=f"golden check of {args.dir}"))
        print("PASS" if res["pass"] else "FAIL")
    return 0 if res["pass"] else 1
