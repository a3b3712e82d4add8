"""ONNX Runtime adapter: TensorRT / CUDA / CPU execution providers, I/O binding on device tensors, CUDA graphs per bucket.

One runner serves one engine file, i.e. one (stage, mode). Inside it:

* **Providers** (`provider_plan`): on `device="cuda[:N]"` with onnxruntime-gpu, `TensorrtExecutionProvider` first when
  a TensorRT library (`libnvinfer.so.10`, what ORT's TensorRT provider links) can be loaded, then
  `CUDAExecutionProvider`, then `CPUExecutionProvider` for what neither takes; on the CPU the CPU provider. The
  reasons for each choice are kept in `runner.notes` (e.g. "TensorRT EP skipped: libnvinfer.so.10 not loadable").
* **I/O binding** (`io_binding`, default on): inputs are bound by device pointer straight from the torch tensors
  the runtime hands over, outputs are written into torch tensors allocated on the same device (their shapes are
  learnt once per input shape, then pre-allocated), so a CUDA call makes no host round trip. The CPU provider takes
  the same path (ORT's IOBinding works on the CPU too), which is what the CPU tests exercise.
* **Static bucket sessions and CUDA graphs** (`static_buckets`, default on CUDA): every static bucket (min length ==
  max length) gets its own session with all free dimensions fixed (`add_free_dimension_override_by_name`, so ORT
  folds the shape arithmetic away and every node can sit on the GPU) and, on CUDA, `enable_cuda_graph=1`. ORT
  captures a graph on the third run (two warm-up runs first), with inputs and outputs bound to fixed addresses: each
  bucket session owns static input / output buffers, the runner copies the padded inputs into them and hands out
  copies of the outputs (what `engines/cudagraph.py` does for torch graphs). Warm-up and capture happen at load,
  not at the first request. A session that ORT refuses to create with a CUDA graph (a node it cannot place on
  the GPU) is created without one and the reason noted. Each bucket session holds its own copy of the weights
  (ORT shares none between sessions): `max_static_sessions` caps how many buckets get one (the costliest first);
  the other buckets, and every dynamic-range bucket, run on the one dynamic-shape session.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from .buckets import Bucket
from .errors import BackendUnavailableError, EngineSetError
from .base import EngineRunner, EngineSpec
from .shapes import resolve_dim

_ORT_TO_NUMPY = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_,
}
_ORT_TO_TORCH = {
    "tensor(float)": torch.float32, "tensor(float16)": torch.float16, "tensor(bfloat16)": torch.bfloat16,
    "tensor(double)": torch.float64, "tensor(int64)": torch.int64, "tensor(int32)": torch.int32,
    "tensor(bool)": torch.bool,
}
# onnx.TensorProto data types, what IOBinding takes for element types numpy lacks (bfloat16)
_TORCH_TO_ONNX = {torch.float32: 1, torch.uint8: 2, torch.int8: 3, torch.int32: 6, torch.int64: 7, torch.bool: 9,
                  torch.float16: 10, torch.float64: 11, torch.bfloat16: 16}
_TORCH_TO_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64,
                   torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_, torch.int8: np.int8,
                   torch.uint8: np.uint8}

TENSORRT_LIBRARIES = ("libnvinfer.so.10",)  # what onnxruntime-gpu 1.2x/1.3x's TensorRT provider links (readelf -d)
CUDA_GRAPH_WARMUP_RUNS = 3  # ORT captures after two plain runs; the third run is the capture


def _import_ort():
    try:
        import onnxruntime as ort
    except ImportError as e:  # pragma: no cover - a hard dependency
        raise BackendUnavailableError("onnxruntime", "onnxruntime", str(e)) from None
    return ort


@dataclass
class OrtOptions:
    """Runner options (`EngineSpec.extra["ort_options"]` or `open_runner(..., options=)`)."""

    intra_op_threads: int = 0
    inter_op_threads: int = 0
    graph_optimization: str = "all"
    io_binding: bool = True
    static_buckets: bool | None = None  # None: on CUDA only
    cuda_graph: bool = True  # on CUDA, in static bucket sessions
    max_static_sessions: int = 64
    tensorrt: bool | None = None  # None: TensorRT EP first when its library loads; False: never; True: required
    cudnn_conv_algo_search: str = "EXHAUSTIVE"  # ORT's default; "HEURISTIC" builds faster
    # TF32 matmuls / convs in the CUDA EP. ORT's default is on; here off: on the H200 (run 23) an fp32 set with TF32
    # was 3e-3 from the fp32 model (DiT mel, SNR 63 dB; HiFT 3.5e-3), over fp32 parity's 1e-3 / 2e-3, while the
    # torch paths (TF32 off) were within 6e-6. Turn it on for speed where that error is acceptable.
    tf32: bool = False

    @staticmethod
    def from_dict(d: dict | None) -> "OrtOptions":
        d = dict(d or {})
        names = set(OrtOptions.__dataclass_fields__)
        unknown = set(d) - names
        if unknown:
            raise EngineSetError(f"unknown onnxruntime runner option(s) {sorted(unknown)}; known: {sorted(names)}")
        return OrtOptions(**d)


def session_options(intra_op_threads: int = 0, inter_op_threads: int = 0, graph_optimization: str = "all",
                    free_dims: dict[str, int] | None = None):
    """Session options exposed to users: thread counts and the graph optimization level (`free_dims`: symbolic
    input dimensions fixed to a value, what a static bucket session uses)."""
    ort = _import_ort()
    so = ort.SessionOptions()
    if intra_op_threads:
        so.intra_op_num_threads = intra_op_threads
    if inter_op_threads:
        so.inter_op_num_threads = inter_op_threads
    levels = {"none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL, "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
    if graph_optimization not in levels:
        raise EngineSetError(f"unknown onnxruntime graph_optimization {graph_optimization!r}; one of {sorted(levels)}")
    so.graph_optimization_level = levels[graph_optimization]
    # no busy-waiting worker threads: they starve torch and the scheduler's threads on small CPU machines
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    for name, value in (free_dims or {}).items():
        so.add_free_dimension_override_by_name(name, int(value))
    return so


def tensorrt_library(libraries: tuple[str, ...] = TENSORRT_LIBRARIES) -> tuple[bool, str]:
    """(loadable, why): whether the TensorRT runtime library ORT's TensorRT provider needs can be loaded here."""
    errors = []
    for lib in libraries:
        try:
            ctypes.CDLL(lib)
            return True, f"{lib} loaded"
        except OSError as e:
            errors.append(f"{lib}: {e}")
    return False, "; ".join(errors) or "no library named"


def _device_id(device) -> int:
    d = torch.device(device)
    return d.index if d.index is not None else 0


def provider_plan(device: str, available: list[str], tensorrt_present: bool, tensorrt_why: str = "",
                  cuda_graph: bool = False, options: OrtOptions | None = None) -> tuple[list, list[str]]:
    """The provider list for `InferenceSession(providers=...)` (names with option dicts) and the reasons.

    Pure: `available` is `ort.get_available_providers()`, `tensorrt_present` whether libnvinfer loads."""
    opts = options or OrtOptions()
    notes: list[str] = []
    if not str(device).startswith("cuda"):
        return ["CPUExecutionProvider"], ["CPU provider (device cpu)"]
    if "CUDAExecutionProvider" not in available:
        raise BackendUnavailableError("onnxruntime", "onnxruntime-gpu",
                                      f"device {device!r} asked for but this onnxruntime has no CUDA provider "
                                      f"(available: {available})")
    dev_id = _device_id(device)
    plan: list = []
    if opts.tensorrt is not False:
        if "TensorrtExecutionProvider" not in available:
            notes.append("TensorRT EP skipped: this onnxruntime build has no TensorrtExecutionProvider")
        elif not tensorrt_present:
            notes.append(f"TensorRT EP skipped: TensorRT library not loadable ({tensorrt_why})")
        else:
            plan.append(("TensorrtExecutionProvider", {"device_id": dev_id}))
            notes.append("TensorRT EP first")
        if opts.tensorrt is True and not plan:
            raise BackendUnavailableError("onnxruntime", "tensorrt", notes[-1])
    cuda = {"device_id": dev_id, "cudnn_conv_algo_search": opts.cudnn_conv_algo_search,
            "do_copy_in_default_stream": "1", "use_tf32": "1" if opts.tf32 else "0"}
    if cuda_graph:
        cuda["enable_cuda_graph"] = "1"
    plan.append(("CUDAExecutionProvider", cuda))
    plan.append("CPUExecutionProvider")
    notes.append("CUDA EP" + (" with CUDA graph" if cuda_graph else ""))
    return plan, notes


def providers_for(device: str) -> list:
    """The provider list for a device (TensorRT first where it can load), as `InferenceSession` takes it."""
    ort = _import_ort()
    present, why = tensorrt_library() if str(device).startswith("cuda") else (False, "")
    return provider_plan(device, ort.get_available_providers(), present, why)[0]


def free_dim_values(session_inputs: list[tuple[str, list]], templates: dict[str, list], bucket: Bucket) -> dict:
    """{symbolic dim name: value} fixing every free input dimension of an ONNX graph at a static bucket's shape.

    `session_inputs`: (name, shape) per graph input, shape entries ints or symbol strings (ORT's `get_inputs()`);
    `templates`: the manifest's shape templates (`engines/shapes.py`). Raises when a symbol would take two values
    or an input has no template."""
    out: dict[str, int] = {}
    for name, shape in session_inputs:
        tpl = templates.get(name)
        if tpl is None:
            raise EngineSetError(f"input {name!r} has no shape template: cannot fix its free dimensions")
        if len(tpl) != len(shape):
            raise EngineSetError(f"input {name!r}: template {tpl} has {len(tpl)} dims, the graph {len(shape)}")
        for dim, expr in zip(shape, tpl):
            if isinstance(dim, int) or dim is None:
                continue
            v = resolve_dim(expr, bucket.batch, bucket.length)
            if out.setdefault(str(dim), v) != v:
                raise EngineSetError(f"free dimension {dim!r} would be both {out[str(dim)]} and {v} "
                                     f"(input {name!r}, bucket {bucket.key})")
    return out


def _bind_tensor(io, name: str, t: torch.Tensor, output: bool = False) -> None:
    """Bind a torch tensor's memory by pointer (no copy) as an input or output."""
    dev_type = "cuda" if t.device.type == "cuda" else "cpu"
    dev_id = (t.device.index or 0) if t.device.type == "cuda" else 0
    etype = _TORCH_TO_NUMPY.get(t.dtype) or _TORCH_TO_ONNX[t.dtype]
    fn = io.bind_output if output else io.bind_input
    fn(name, dev_type, dev_id, etype, list(t.shape), t.data_ptr())


def _ortvalue_to_torch(value, device: torch.device) -> torch.Tensor:
    """An OrtValue as a torch tensor: zero-copy through DLPack where this onnxruntime has it, else via numpy."""
    if hasattr(value, "__dlpack__"):
        try:
            return torch.from_dlpack(value).clone()
        except Exception:  # noqa: BLE001 - older builds: the numpy path below
            pass
    return torch.from_numpy(np.ascontiguousarray(value.numpy())).to(device)


class _StaticBucket:
    """One static bucket's session: fixed-address inputs and outputs, CUDA graph captured on the warm-up runs."""

    def __init__(self, session, io, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor],
                 run_options, graph: bool):
        self.session, self.io, self.inputs, self.outputs = session, io, inputs, outputs
        self.run_options, self.graph = run_options, graph


class OnnxRuntimeRunner(EngineRunner):
    backend = "onnxruntime"

    def __init__(self, path: str, spec: EngineSpec, device: str = "cpu", options: dict | OrtOptions | None = None):
        super().__init__(path, spec, device)
        ort = _import_ort()
        self._ort = ort
        if options is None:
            options = spec.extra.get("ort_options")
        self.options = options if isinstance(options, OrtOptions) else OrtOptions.from_dict(options)
        self.cuda = self.device.type == "cuda"
        self.notes: list[str] = []
        trt_present, trt_why = tensorrt_library() if self.cuda else (False, "")
        self._plan_args = (str(self.device), ort.get_available_providers(), trt_present, trt_why)
        providers, notes = provider_plan(*self._plan_args, cuda_graph=False, options=self.options)
        self.notes += notes
        self.session = self._session(providers)
        self.providers = self.session.get_providers()
        ins = self.session.get_inputs()
        self._in_types = {i.name: _ORT_TO_NUMPY.get(i.type, np.float32) for i in ins}
        self._in_torch = {i.name: _ORT_TO_TORCH.get(i.type, torch.float32) for i in ins}
        self._in_shapes = [(i.name, list(i.shape)) for i in ins]
        names = set(self._in_types)
        if set(spec.input_names) != names:
            raise EngineSetError(f"{path}: ONNX inputs {sorted(names)} differ from the manifest's {spec.input_names}")
        self._out_shapes: dict[tuple, dict[str, tuple]] = {}  # input shapes -> output shapes (learnt once)
        self._run_options = ort.RunOptions()
        self.static: dict[str, _StaticBucket] = {}
        want_static = self.options.static_buckets if self.options.static_buckets is not None else self.cuda
        if want_static and self.options.io_binding:
            self._build_static_buckets()

    # ------------------------------------------------------------------ sessions
    def _session(self, providers, free_dims: dict | None = None):
        o = self.options
        so = session_options(o.intra_op_threads, o.inter_op_threads, o.graph_optimization, free_dims)
        return self._ort.InferenceSession(self.path, sess_options=so, providers=providers)

    def _build_static_buckets(self) -> None:
        from .buckets import parse_key

        templates = self.spec.extra.get("input_shapes")
        if not templates:
            self.notes.append("no static bucket sessions: the manifest has no input shape templates")
            return
        buckets = [parse_key(k) for k in self.spec.buckets]
        static = sorted((b for b in buckets if not b.dynamic), key=lambda b: -b.cost)
        if len(static) > self.options.max_static_sessions:
            self.notes.append(f"{len(static) - self.options.max_static_sessions} static buckets run on the dynamic "
                              f"session (max_static_sessions={self.options.max_static_sessions})")
            static = static[:self.options.max_static_sessions]
        for b in static:
            self.static[b.key] = self._static_bucket(b, templates)
        graphs = sum(s.graph for s in self.static.values())
        self.notes.append(f"{len(self.static)} static bucket sessions, {graphs} with a CUDA graph")

    def _static_bucket(self, bucket: Bucket, templates: dict) -> _StaticBucket:
        dims = free_dim_values(self._in_shapes, templates, bucket)
        graph = self.cuda and self.options.cuda_graph
        session = None
        if graph:
            providers, _ = provider_plan(*self._plan_args, cuda_graph=True, options=self.options)
            try:
                session = self._session(providers, dims)
            except Exception as e:  # noqa: BLE001 - ORT refuses a CUDA graph when a node is not on the GPU
                self.notes.append(f"{bucket.key}: no CUDA graph ({type(e).__name__}: {str(e)[:200]})")
                graph = False
        if session is None:
            providers, _ = provider_plan(*self._plan_args, cuda_graph=False, options=self.options)
            session = self._session(providers, dims)
        inputs = {}
        from .shapes import resolve_shape

        for name in self.spec.input_names:
            shape = resolve_shape(templates[name], bucket.batch, bucket.length)
            dt = self._in_torch[name]
            inputs[name] = (torch.ones if name == "mask" else torch.zeros)(shape, dtype=dt, device=self.device)
        # output shapes: one run of the dynamic-shape session with ORT-allocated outputs (a CUDA-graph session is
        # only ever run on its fixed buffers), then fixed torch buffers
        probe = self.session.io_binding()
        for name, t in inputs.items():
            _bind_tensor(probe, name, t)
        for name in self.spec.output_names:
            probe.bind_output(name, "cuda" if self.cuda else "cpu", _device_id(self.device) if self.cuda else 0)
        self._sync()
        self.session.run_with_iobinding(probe)
        outputs = {}
        for name, v in zip(self.spec.output_names, probe.get_outputs()):
            outputs[name] = torch.empty(tuple(v.shape()), dtype=_ORT_TO_TORCH.get(_ort_type(v), torch.float32),
                                        device=self.device)
        del probe
        try:
            return self._warm(session, inputs, outputs, graph)
        except Exception as e:  # noqa: BLE001 - a capture ORT refuses at run time: the same session, no graph
            if not graph:
                raise
            self.notes.append(f"{bucket.key}: CUDA graph capture failed ({type(e).__name__}: {str(e)[:200]})")
            providers, _ = provider_plan(*self._plan_args, cuda_graph=False, options=self.options)
            return self._warm(self._session(providers, dims), inputs, outputs, False)

    def _warm(self, session, inputs: dict, outputs: dict, graph: bool) -> _StaticBucket:
        """Bind the fixed buffers and run: two warm-up runs and the capture with a CUDA graph, one run without."""
        io = session.io_binding()
        for name, t in inputs.items():
            _bind_tensor(io, name, t)
        for name, t in outputs.items():
            _bind_tensor(io, name, t, output=True)
        ro = self._ort.RunOptions()
        for _ in range(CUDA_GRAPH_WARMUP_RUNS if graph else 1):  # the capture happens here, not at a request
            session.run_with_iobinding(io, ro)
        self._done(io)
        return _StaticBucket(session, io, inputs, outputs, ro, graph)

    def _sync(self) -> None:
        """Inputs written on torch's stream must have landed before ORT, which runs on its own stream, reads them."""
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def _done(self, io) -> None:
        """ORT's outputs complete before torch's stream reads them (IOBinding.synchronize_outputs waits on the EP's
        stream; ORT also synchronizes at the end of a run unless told not to)."""
        if self.cuda:
            io.synchronize_outputs()

    # ------------------------------------------------------------------ running
    def run(self, inputs: dict[str, torch.Tensor], bucket: Bucket) -> dict[str, torch.Tensor]:
        for name in self.spec.input_names:
            if name not in inputs:
                raise EngineSetError(f"{self.path}: missing input {name!r}")
        sb = self.static.get(bucket.key)
        if sb is not None:
            return self._run_static(sb, inputs, bucket)
        if self.options.io_binding:
            return self._run_bound(inputs)
        return self._run_host(inputs)

    def _run_static(self, sb: _StaticBucket, inputs: dict[str, torch.Tensor], bucket: Bucket) -> dict:
        for name, buf in sb.inputs.items():
            src = inputs[name]
            if tuple(src.shape) != tuple(buf.shape):
                raise EngineSetError(f"{self.path}: input {name!r} of shape {tuple(src.shape)} does not fit bucket "
                                     f"{bucket.key} {tuple(buf.shape)}")
            buf.copy_(src)
        self._sync()
        sb.session.run_with_iobinding(sb.io, sb.run_options)
        self._done(sb.io)
        return {n: t.clone() for n, t in sb.outputs.items()}

    def _run_bound(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        io = self.session.io_binding()
        feeds = {}
        for name in self.spec.input_names:
            t = inputs[name].detach()
            if t.device != self.device:
                t = t.to(self.device)
            t = t.to(self._in_torch[name]).contiguous()
            feeds[name] = t  # kept alive until the run returns
            _bind_tensor(io, name, t)
        key = tuple(tuple(t.shape) for t in feeds.values())
        shapes = self._out_shapes.get(key)
        outs: dict[str, torch.Tensor] = {}
        if shapes is not None:
            for name in self.spec.output_names:
                dt, shape = shapes[name]
                outs[name] = torch.empty(shape, dtype=dt, device=self.device)
                _bind_tensor(io, name, outs[name], output=True)
        else:
            for name in self.spec.output_names:
                io.bind_output(name, "cuda" if self.cuda else "cpu", _device_id(self.device) if self.cuda else 0)
        self._sync()
        self.session.run_with_iobinding(io, self._run_options)
        self._done(io)
        if shapes is None:
            for name, v in zip(self.spec.output_names, io.get_outputs()):
                outs[name] = _ortvalue_to_torch(v, self.device)
            self._out_shapes[key] = {n: (t.dtype, tuple(t.shape)) for n, t in outs.items()}
        return outs

    def _run_host(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The numpy path (a host round trip): `io_binding=False`, and the reference the tests compare with."""
        feeds = {}
        for name in self.spec.input_names:
            feeds[name] = inputs[name].detach().cpu().numpy().astype(self._in_types[name], copy=False)
        outs = self.session.run(self.spec.output_names, feeds)
        return {n: torch.from_numpy(np.ascontiguousarray(o)).to(self.device) for n, o in zip(self.spec.output_names, outs)}

    def close(self) -> None:
        self.static.clear()
        self.session = None


def _ort_type(value) -> str:
    """An OrtValue's element type as ORT's type string ("tensor(float)")."""
    dt = value.data_type() if hasattr(value, "data_type") else "tensor(float)"
    return dt
