"""What every benchmark suite shares: the log line, the results file with its time budget (`Bench`), the full-size
models with seeded random weights, the pipeline over them (tiny ONNX frontends, a saved speaker as its voice), and
the serving variants' pipeline and scheduler settings. Imports nothing else of the bench package."""
from __future__ import annotations

import json
import os
import subprocess
import time

import torch

from ...engines.errors import InputError  # noqa: F401 - first: engines/ before runtime.models (import order)
from ...engines.dtypes import TORCH_DTYPES as DTYPES

H200_HBM_BPS = 4.8e12
H200_BF16_FLOPS = 790e12
# graphs_ar: the graphs variant with the AR prefill / decode compiled (SchedulerConfig.compile), DiT and HiFT eager in
# graphs: about a minute of compile instead of the compiled variant's 4-9, and the graphs variant's bottleneck (the
# eager AR step, busy 0.96 at 4 req/s in run 24) gone
# engines: the DiT / HiFT of an engine set (`--engines DIR`, e.g. ONNX Runtime on CUDA; built with
# `trtbuild build --model random-full`), the AR in torch with its decode graphs
VARIANTS = ("compiled", "graphs", "eager", "graphs_ar", "engines")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def full_models(device: str, dtype: torch.dtype, which: str = "full"):
    """Full-size (or tiny) architecture with seeded random weights, built directly on the device."""
    from ...runtime.models.config import full_config, tiny_config
    from ...runtime.models.loading import build_modules

    cfg = full_config() if which == "full" else tiny_config()
    torch.manual_seed(0)
    llm, flow, hift = build_modules(cfg, device=device)
    with torch.no_grad():
        hift.f0_predictor.classifier.bias.fill_(180.0)
    hift.fold_weight_norm()
    llm.to(dtype)
    flow.to(dtype)
    return cfg, llm.eval(), flow.eval(), hift.eval()


def random_models(cfg, llm, flow, hift, which: str = "full"):
    """`full_models`' modules as CosyVoice3Models, labelled as `trtbuild build --model random-full` labels the same
    seeded weights ("random-full-seed0"), so an engine set built that way opens against them (`--variants engines`)."""
    from ...runtime.models.loading import CosyVoice3Models

    return CosyVoice3Models(cfg, llm, flow, hift, f"random-{which}", "", f"random-{which}-seed0")


class Bench:
    """The results of one run (`results`, written to OUT/results.json after every section) and its time budget."""

    def __init__(self, args):
        self.args = args
        self.t0 = time.perf_counter()
        self.results: dict = {"meta": self._meta(args)}
        os.makedirs(args.out, exist_ok=True)

    def _meta(self, args) -> dict:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__, "model": args.model,
                "dtype": args.dtype, "graph_profile": getattr(args, "graph_profile", None)}
        if torch.cuda.is_available():
            meta["gpu"] = torch.cuda.get_device_name(0)
        meta["commit"] = os.environ.get("COSYTRT_COMMIT", "")  # set by the caller where the tree has no .git
        if not meta["commit"]:
            try:
                meta["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                text=True).stdout.strip()
            except OSError:
                pass
        return meta

    def over_budget(self) -> bool:
        return time.perf_counter() - self.t0 > self.args.budget_s

    def save(self) -> None:
        with open(os.path.join(self.args.out, "results.json"), "w") as f:
            json.dump(self.results, f, indent=1)

    def section(self, name: str, fn) -> None:
        if self.over_budget():
            log(f"skip {name}: time budget spent")
            self.results.setdefault("skipped", []).append(name)
            return
        log(f"start {name}")
        t = time.perf_counter()
        try:
            self.results[name] = fn()
        except Exception as e:  # noqa: BLE001 - a failing section must not lose the others
            import traceback

            traceback.print_exc()
            partial = self.results.get(name)  # what the section saved before it failed stays
            self.results[name] = {**partial, "error": repr(e)} if isinstance(partial, dict) else {"error": repr(e)}
        log(f"done {name} in {time.perf_counter() - t:.1f}s")
        self.save()
        if self.args.compile_cache:  # after every section: a run cut short still leaves its compiles behind
            from ...runtime.stages.compiled import save_compile_cache

            log(f"saved compile cache {self.args.compile_cache}: "
                f"{save_compile_cache(self.args.compile_cache) / 1e6:.1f} MB")


def pipeline_with_random_frontend(models):
    """A pipeline over in-memory random models with the tiny ONNX frontends and a synthetic saved speaker as its
    voice (`pipeline.default_speaker`)."""
    import tempfile

    from ...runtime.models.frontend import Frontend, SavedSpeaker
    from ...runtime.models.text import ByteTokenizer
    from ...runtime.models.tiny_frontends import write_tiny_frontends
    from ...runtime.stages.request import default_voice_wav
    from ...runtime.stages.pipeline import Pipeline

    d = tempfile.mkdtemp()
    tok_path, spk_path = write_tiny_frontends(d)
    fe = Frontend(ByteTokenizer(models.config.llm.qwen.vocab_size), tok_path, spk_path)
    feats = fe.prompt_features(default_voice_wav(16000, 3.0), 16000)
    return Pipeline(models, fe, SavedSpeaker(features=feats, prompt_text="a prompt of three seconds"))


def scheduler_config(variant: str, **overrides):
    """The serving benchmarks' scheduler settings for a variant (compiled / graphs / eager)."""
    from ...runtime.scheduling.scheduler import SchedulerConfig

    return SchedulerConfig(**{**dict(max_in_flight=128, ar_max_batch=64, dit_max_requests=8, hift_max_batch=16,
                                     cuda_graphs=variant != "eager", compile=variant in ("compiled", "graphs_ar"),
                                     ar_max_len=2048), **overrides})


def make_pipeline(models, variant: str, graph_profile: str, engines: str | None = None):
    """The variant's pipeline: eager modules, or their CUDA graphs per bucket of `graph_profile` (compiled first for
    the compiled variant; on the CPU the compiled variant runs the compiled modules without graphs), or the engine
    set `engines` (variant "engines")."""
    from ...runtime.stages.engine_set import attach_cuda_graphs, attach_engine_set
    from ...runtime.stages.profile import load_profile

    pipe = pipeline_with_random_frontend(models)
    if variant == "eager":
        return pipe
    if variant == "engines":
        if not engines:
            raise InputError("the 'engines' serving variant needs --engines DIR (an engine set of these weights: "
                             "trtbuild build --model random-full ...)")
        attach_engine_set(pipe, engines)
        return pipe
    if pipe.device.type == "cuda":
        attach_cuda_graphs(pipe, load_profile(graph_profile), compile=variant == "compiled")
    elif variant == "compiled":
        from ...runtime.stages.compiled import compiled_backends

        pipe.set_backends(compiled_backends(pipe.models))
    else:
        raise InputError(f"the {variant!r} serving variant needs CUDA")
    return pipe


def start_tts(pipe, sched_cfg, tts=None):
    """A TTS over `pipe` with its scheduler started (AR graphs captured) and warmed up by two short requests. With
    `tts` (one over the same pipeline): its scheduler is swapped for one with `sched_cfg` over the same AR runner
    when the runner's fields agree (`TTS.reconfigure`: no AR compile or graph capture again), else it is closed
    (its backends kept) and a new TTS is built."""
    from ...runtime.scheduling.scheduler import ar_runner_differences
    from ...runtime.tts import TTS

    if tts is not None:
        if ar_runner_differences(sched_cfg, tts.scheduler_config):
            tts.close(close_backends=False)
            tts = None
        else:
            tts.reconfigure(sched_cfg)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the old scheduler's prefix pool: free before the new one sizes its own
    if tts is None:
        tts = TTS(pipe, scheduler=sched_cfg)
    else:  # reconfigure keeps the TTS's admission control: give it this setting's limits (an A/B over them)
        tts.admission.configure(max_in_flight=sched_cfg.max_in_flight, max_waiting=sched_cfg.max_waiting,
                                timeout_s=sched_cfg.submit_timeout_s, on_full=sched_cfg.on_full)
    tts.synthesize("a" * 40, seed=0, force_tokens=50)  # starts the scheduler (captures decode graphs), warms up
    list(tts.stream("a" * 40, seed=0, force_tokens=50))
    return tts


def jsonable(d):
    return json.loads(json.dumps(d, default=str))
