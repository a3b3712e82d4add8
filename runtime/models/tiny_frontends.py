"""Tiny stand-ins for the two ONNX frontends, with the real ones' signatures (seeded, deterministic).

- `speech_tokenizer_v3.onnx`: input [0] float32 (1, 128, T) Whisper log-mel, input [1] int32 [1] frame count;
  output [0] int64 (1, T // 4) speech tokens in [0, 6561) at 25 Hz (4-frame average pool, centring over bins,
  a random projection to 6561 logits, argmax), output [1] int32 [1] token count.
- `campplus.onnx`: input `input` float32 (1, T, 80) fbank -> output float32 (1, 192) (per-frame linear + tanh,
  mean over time: a plain mean-pool of mean-subtracted fbank would be all zeros).
"""
from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SPEECH_TOKENIZER_FILE = "speech_tokenizer_v3.onnx"
CAMPPLUS_FILE = "campplus.onnx"
OPSET = 17


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="cosytrt-tiny")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def tiny_speech_tokenizer(seed: int = 0, n_mels: int = 128, vocab: int = 6561,
                          frames_per_token: int = 4) -> onnx.ModelProto:
    """(1, n_mels, T) log-mel + int32 [1] length -> (1, T // frames_per_token) int64 tokens (4: 25 Hz, as real)."""
    rng = np.random.default_rng(seed)
    proj = rng.standard_normal((n_mels, vocab)).astype(np.float32)
    k = frames_per_token
    nodes = [
        helper.make_node("AveragePool", ["feats"], ["pooled"], kernel_shape=[k], strides=[k]),  # (1, C, T//k)
        helper.make_node("Transpose", ["pooled"], ["frames"], perm=[0, 2, 1]),                 # (1, T//k, C)
        helper.make_node("ReduceMean", ["frames"], ["frame_mean"], axes=[-1], keepdims=1),
        helper.make_node("Sub", ["frames", "frame_mean"], ["centred"]),
        helper.make_node("MatMul", ["centred", "proj"], ["logits"]),                           # (1, T//k, V)
        helper.make_node("ArgMax", ["logits"], ["indices"], axis=-1, keepdims=0),              # (1, T//k) int64
        helper.make_node("Div", ["feats_length", "frames_per_token"], ["indices_length"]),     # int32 [1]
    ]
    graph = helper.make_graph(
        nodes, "tiny_speech_tokenizer_v3",
        inputs=[helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, n_mels, "T"]),
                helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1])],
        outputs=[helper.make_tensor_value_info("indices", TensorProto.INT64, [1, "T_tok"]),
                 helper.make_tensor_value_info("indices_length", TensorProto.INT32, [1])],
        initializer=[numpy_helper.from_array(proj, "proj"),
                     numpy_helper.from_array(np.array([k], dtype=np.int32), "frames_per_token")])
    return _model(graph)


def tiny_campplus(seed: int = 1, n_bins: int = 80, dim: int = 192) -> onnx.ModelProto:
    """(1, T, n_bins) fbank -> (1, dim) speaker embedding."""
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((n_bins, dim)) / np.sqrt(n_bins)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(dim)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["input", "weight"], ["projected"]),
        helper.make_node("Add", ["projected", "bias"], ["shifted"]),
        helper.make_node("Tanh", ["shifted"], ["activated"]),
        helper.make_node("ReduceMean", ["activated"], ["output"], axes=[1], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "tiny_campplus",
        inputs=[helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, "T", n_bins])],
        outputs=[helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, dim])],
        initializer=[numpy_helper.from_array(weight, "weight"), numpy_helper.from_array(bias, "bias")])
    return _model(graph)


def write_tiny_frontends(directory: str, seed: int = 0) -> tuple[str, str]:
    """Write `speech_tokenizer_v3.onnx` and `campplus.onnx` into `directory`; return their paths."""
    os.makedirs(directory, exist_ok=True)
    tok_path = os.path.join(directory, SPEECH_TOKENIZER_FILE)
    spk_path = os.path.join(directory, CAMPPLUS_FILE)
    onnx.save(tiny_speech_tokenizer(seed), tok_path)
    onnx.save(tiny_campplus(seed + 1), spk_path)
    return tok_path, spk_path
