"""DiT -> ONNX export: symbolic batch/T, ORT CPU equals eager (1e-3), offline and streaming graphs, ragged masks."""
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import load_file

from cosytrt.build.export_dit import INPUT_NAMES, OUTPUT_NAME, example_inputs, export_dit_onnx
from cosytrt.runtime.models.config import config_from_golden_json
from cosytrt.engines.errors import InputError
from cosytrt.runtime.models.flow import Flow

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden")
TOL = 1e-3
SHAPES = [(2, 50), (4, 100), (6, 137), (1, 7), (3, 256)]


@pytest.fixture(scope="module")
def flow():
    cfg = config_from_golden_json(os.path.join(GOLDEN, "config.json")).flow
    return Flow(cfg).eval().load_checkpoint(os.path.join(GOLDEN, "flow.pt"))


@pytest.fixture(scope="module")
def sessions(flow, tmp_path_factory):
    out = tmp_path_factory.mktemp("dit_onnx")
    paths, sess = {}, {}
    for streaming in (False, True):
        # example shapes differ from the test shapes on purpose
        p = export_dit_onnx(flow.estimator, str(out / f"dit_{'stream' if streaming else 'offline'}.onnx"),
                            streaming=streaming, example_batch=2, example_frames=256)
        paths[streaming] = p
        sess[streaming] = ort.InferenceSession(p, providers=["CPUExecutionProvider"])
    return paths, sess


def _run(sess, args):
    return sess.run([OUTPUT_NAME], {n: a.numpy() for n, a in zip(INPUT_NAMES, args)})[0]


def _ragged(flow, lengths, T, seed):
    args = list(example_inputs(flow.estimator, len(lengths), T, seed=seed))
    for i, n in enumerate(lengths):
        args[1][i, :, n:] = 0
    return args


@pytest.mark.parametrize("streaming", [False, True])
def test_graph_io_is_symbolic(sessions, streaming):
    model = onnx.load(sessions[0][streaming])
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert list(dims) == list(INPUT_NAMES)
    assert [o.name for o in model.graph.output] == [OUTPUT_NAME]
    b = dims["x"][0]
    s = dims["x"][2]
    assert isinstance(b, str) and isinstance(s, str) and b != s
    assert dims["x"] == dims["mu"] == dims["cond"] == [b, 80, s]
    assert dims["mask"] == [b, 1, s] and dims["t"] == [b] and dims["spks"] == [b, 80]
    out = [d.dim_param or d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    assert out == [b, 80, s]


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("B,T", SHAPES)
def test_ort_equals_eager(flow, sessions, streaming, B, T):
    args = example_inputs(flow.estimator, B, T, seed=B * 1000 + T)
    with torch.no_grad():
        ref = flow.estimator(*args, streaming=streaming).numpy()
    out = _run(sessions[1][streaming], args)
    assert out.shape == (B, 80, T)
    err = np.abs(out - ref).max()
    assert err <= TOL, f"streaming={streaming} B={B} T={T}: max err {err}"


@pytest.mark.parametrize("streaming", [False, True])
def test_ort_ragged_mask(flow, sessions, streaming):
    lengths, T = [137, 80, 23, 51], 137
    args = _ragged(flow, lengths, T, seed=11)
    with torch.no_grad():
        ref = flow.estimator(*args, streaming=streaming).numpy()
    out = _run(sessions[1][streaming], args)
    assert np.abs(out - ref).max() <= TOL
    # each row's valid frames equal that row run alone at its own length
    for i, n in enumerate(lengths):
        alone = [a[i:i + 1, :, :n] if a.ndim == 3 else a[i:i + 1] for a in args]
        alone_out = _run(sessions[1][streaming], alone)
        assert np.abs(out[i:i + 1, :, :n] - alone_out).max() <= TOL


def test_streaming_graph_differs_from_offline(flow, sessions):
    args = example_inputs(flow.estimator, 2, 120, seed=5)
    off, st = _run(sessions[1][False], args), _run(sessions[1][True], args)
    assert np.abs(off[:, :, :50] - st[:, :, :50]).max() > 1e-2  # block-causal mask is baked into the graph


def test_ort_estimator_in_flow_matches_golden(flow, sessions):
    v = load_file(os.path.join(GOLDEN, "vectors.safetensors"))

    def ort_estimator(x, mask, mu, t, spks, cond, streaming=False):
        return torch.from_numpy(_run(sessions[1][streaming], (x, mask, mu, t, spks, cond)))

    flow.set_noise(v["flow.rand_noise"])
    try:
        for name, streaming, finalize in (("offline", False, True), ("stream", True, False)):
            mel = flow.inference(v["flow.token"], v["flow.prompt_token"], v["flow.prompt_feat"], v["flow.embedding"],
                                 streaming=streaming, finalize=finalize, estimator=ort_estimator)
            assert (mel - v[f"flow.{name}.mel"]).abs().max().item() <= TOL
    finally:
        flow.set_noise(Flow(flow.cfg).rand_noise)


def test_export_rejects_bad_args(flow, tmp_path):
    with pytest.raises(InputError, match="dtype"):
        export_dit_onnx(flow.estimator, str(tmp_path / "a.onnx"), streaming=False, dtype=torch.float64)
    with pytest.raises(InputError, match="example_batch"):
        export_dit_onnx(flow.estimator, str(tmp_path / "a.onnx"), streaming=False, example_batch=1)


def test_fp16_export_runs_with_half_io(flow, tmp_path):
    # fp16 export = the module cast to fp16; judged by cosine / SNR against the fp32 eager output
    p = export_dit_onnx(flow.estimator, str(tmp_path / "dit_fp16.onnx"), streaming=True, dtype=torch.float16)
    sess = ort.InferenceSession(p, providers=["CPUExecutionProvider"])
    assert all(i.type == "tensor(float16)" for i in sess.get_inputs())
    args = _ragged(flow, [137, 90, 60], 137, seed=3)
    with torch.no_grad():
        ref = flow.estimator(*args, streaming=True).numpy()
    out = _run(sess, [a.half() for a in args]).astype(np.float32)
    cos = float((out * ref).sum() / (np.linalg.norm(out) * np.linalg.norm(ref)))
    snr = 10 * np.log10((ref ** 2).sum() / ((out - ref) ** 2).sum())
    assert cos > 0.9999 and snr > 35, (cos, snr)
