"""Placement and sizing of the Ray Serve cluster (`trtbuild serve --cluster ray --config FILE`); no Ray import here.

    model: /models/CosyVoice3-0.5B     # optional; default: --model
    ray_address: auto                  # optional; default: a local Ray (or $RAY_ADDRESS)
    server: {max_in_flight: 64}        # optional ServerSettings fields for the ingress (override the CLI flags)
    stages:
      frontend:  {replicas: 2, num_cpus: 1}
      ar:        {replicas: 1, num_gpus: 1, dtype: bfloat16, scheduler: {ar_max_batch: 64}}
      token2wav: {num_gpus: 1, engines: /engines/h200, autoscaling: {min_replicas: 1, max_replicas: 3}}
      ingress:   {replicas: 1}

Stage keys: `replicas` (or `autoscaling`: Ray Serve's autoscaling_config, passed through), `num_cpus`, `num_gpus`
(fractions share a GPU; at most 1: a replica drives one device), `device` (default cuda when num_gpus > 0),
`dtype`, `engines` (token2wav only: an engine set folder), `scheduler` (SchedulerConfig fields, ar / token2wav),
`max_ongoing_requests`, `torch_threads`, `ray_actor_options` (extra Ray actor options, e.g. accelerator_type).
See profiles/cluster-example.yaml for the Triton-recipe layout (one AR GPU feeding several token2wav GPUs).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from ...engines.errors import InputError

STAGES = ("frontend", "ar", "token2wav", "ingress")
SHIPPED_CONFIGS = ("cluster-example",)  # in cosytrt.profiles
from ...engines.dtypes import DTYPES  # noqa: E402
_STAGE_KEYS = ("replicas", "autoscaling", "num_cpus", "num_gpus", "device", "dtype", "engines", "scheduler",
               "max_ongoing_requests", "torch_threads", "ray_actor_options")
_TOP_KEYS = ("model", "ray_address", "app_name", "server", "stages")
_MODEL_STAGES = ("ar", "token2wav")  # the stages that hold model weights on a device


@dataclass
class StageConfig:
    """One deployment's placement and sizing."""

    replicas: int = 1
    autoscaling: dict | None = None        # Ray Serve autoscaling_config (min_replicas, max_replicas, ...)
    num_cpus: float = 0.5                 # a Ray scheduling reservation, not a limit
    num_gpus: float = 0.0
    device: str = "cpu"
    dtype: str | None = None               # LM / flow dtype (HiFT stays float32); None: float32
    engines: str | None = None             # token2wav: engine set folder (DiT / HiFT engines)
    scheduler: dict = field(default_factory=dict)  # SchedulerConfig fields
    max_ongoing_requests: int | None = None
    torch_threads: int | None = None
    ray_actor_options: dict = field(default_factory=dict)

    def actor_options(self) -> dict:
        return {**self.ray_actor_options, "num_cpus": self.num_cpus, "num_gpus": self.num_gpus}

    def deployment_options(self, default_ongoing: int) -> dict:
        """Keyword arguments for Ray Serve's `Deployment.options`."""
        out = {"ray_actor_options": self.actor_options(),
               "max_ongoing_requests": self.max_ongoing_requests or default_ongoing}
        if self.autoscaling is not None:
            out["autoscaling_config"] = dict(self.autoscaling)
        else:
            out["num_replicas"] = self.replicas
        return out

    def scheduler_config(self):
        from ..scheduling.scheduler import SchedulerConfig

        return SchedulerConfig(**self.scheduler)


@dataclass
class ClusterConfig:
    model: str | None = None       # None: the CLI's --model (or "tiny")
    ray_address: str | None = None
    app_name: str = "cosytrt"
    server: dict = field(default_factory=dict)
    frontend: StageConfig = field(default_factory=StageConfig)
    ar: StageConfig = field(default_factory=StageConfig)
    token2wav: StageConfig = field(default_factory=StageConfig)
    ingress: StageConfig = field(default_factory=StageConfig)
    source: str = "<defaults>"

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> "ClusterConfig":
        return _Parser(source).config(data)

    def to_dict(self) -> dict:
        out = {"model": self.model, "ray_address": self.ray_address, "app_name": self.app_name,
               "server": dict(self.server), "stages": {}}
        for s in STAGES:
            out["stages"][s] = dataclasses.asdict(getattr(self, s))
        return out


def load_cluster_config(path: str | os.PathLike | None) -> ClusterConfig:
    """Read a cluster YAML, a path or a shipped name (None: one replica per stage on CPU); InputError naming the
    file and key."""
    if path is None:
        return ClusterConfig()
    import yaml

    p = os.fspath(path)
    if os.path.isfile(p):
        with open(p, encoding="utf-8") as f:
            text = f.read()
    elif p in SHIPPED_CONFIGS:
        from importlib import resources

        res = resources.files("cosytrt.profiles").joinpath(f"{p}.yaml")
        text, p = res.read_text(encoding="utf-8"), str(res)
    else:
        raise InputError(f"cluster config file not found: {p} (shipped: {', '.join(SHIPPED_CONFIGS)})")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise InputError(f"{p}: not valid YAML ({e})") from None
    return ClusterConfig.from_dict(data if data is not None else {}, p)


class _Parser:
    def __init__(self, source: str):
        self.source = source

    def fail(self, where: str, msg: str, value: Any = ...):
        got = "" if value is ... else f", got {value!r}"
        raise InputError(f"{self.source}: {where}: {msg}{got}")

    def mapping(self, v, where: str, allowed) -> dict:
        if not isinstance(v, dict):
            self.fail(where, "must be a mapping", v)
        for k in v:
            if k not in allowed:
                self.fail(where, f"unknown key {k!r}; allowed: {', '.join(allowed)}")
        return v

    def number(self, v, where: str, *, integer: bool = False, minimum: float = 0.0, inclusive: bool = True):
        ok = isinstance(v, int if integer else (int, float)) and not isinstance(v, bool)
        if not ok or (v < minimum if inclusive else v <= minimum):
            what = "an integer" if integer else "a number"
            self.fail(where, f"must be {what} {'>=' if inclusive else '>'} {minimum:g}", v)
        return v

    def config(self, data) -> ClusterConfig:
        d = self.mapping(data, "top level", _TOP_KEYS)
        cfg = ClusterConfig(source=self.source)
        for key in ("model", "ray_address", "app_name"):
            if d.get(key) is not None:
                if not isinstance(d[key], str) or not d[key]:
                    self.fail(key, "must be a non-empty string", d[key])
                setattr(cfg, key, d[key])
        if d.get("server") is not None:
            cfg.server = self.server(d["server"])
        stages = self.mapping(d.get("stages") or {}, "stages", STAGES)
        for name in STAGES:
            setattr(cfg, name, self.stage(name, stages.get(name) or {}))
        return cfg

    def server(self, v) -> dict:
        from ..serving import ServerSettings

        names = [f.name for f in dataclasses.fields(ServerSettings)]
        self.mapping(v, "server", names)
        try:
            ServerSettings(**v)
        except InputError as e:
            self.fail("server", str(e))
        return dict(v)

    def stage(self, name: str, v) -> StageConfig:
        where = f"stages.{name}"
        d = self.mapping(v, where, _STAGE_KEYS)
        st = StageConfig()
        if "replicas" in d and "autoscaling" in d:
            self.fail(where, "give 'replicas' or 'autoscaling', not both")
        if "replicas" in d:
            st.replicas = self.number(d["replicas"], f"{where}.replicas", integer=True, minimum=1)
        if d.get("autoscaling") is not None:
            st.autoscaling = self.autoscaling(d["autoscaling"], f"{where}.autoscaling")
        if "num_cpus" in d:
            st.num_cpus = float(self.number(d["num_cpus"], f"{where}.num_cpus"))
        if "num_gpus" in d:
            g = self.number(d["num_gpus"], f"{where}.num_gpus")
            if g > 1:
                self.fail(f"{where}.num_gpus", "must be at most 1 (a replica drives one GPU; run more replicas "
                                               "to use more GPUs)", g)
            st.num_gpus = float(g)
        if st.num_gpus > 0 and name not in _MODEL_STAGES:
            self.fail(f"{where}.num_gpus", f"the {name} stage runs on CPU; only {' and '.join(_MODEL_STAGES)} "
                                           f"take GPUs", st.num_gpus)
        device = d.get("device")
        if device is None:
            device = "cuda" if st.num_gpus > 0 else "cpu"
        if not isinstance(device, str) or device.split(":")[0] not in ("cpu", "cuda"):
            self.fail(f"{where}.device", "must be 'cpu' or 'cuda'", device)
        if device.startswith("cuda") and st.num_gpus <= 0:
            self.fail(f"{where}.device", "'cuda' needs num_gpus > 0 (Ray gives a replica no GPU otherwise)", device)
        if device != "cpu" and name not in _MODEL_STAGES:
            self.fail(f"{where}.device", f"the {name} stage runs on CPU", device)
        st.device = device
        if d.get("dtype") is not None:
            if name not in _MODEL_STAGES:
                self.fail(f"{where}.dtype", f"only {' and '.join(_MODEL_STAGES)} hold model weights", d["dtype"])
            if d["dtype"] not in DTYPES:
                self.fail(f"{where}.dtype", f"must be one of {', '.join(DTYPES)}", d["dtype"])
            st.dtype = d["dtype"]
        if d.get("engines") is not None:
            if name != "token2wav":
                self.fail(f"{where}.engines", "engine sets hold the DiT and HiFT: only the token2wav stage takes "
                                              "one", d["engines"])
            if not isinstance(d["engines"], str) or not d["engines"]:
                self.fail(f"{where}.engines", "must be an engine set folder", d["engines"])
            st.engines = d["engines"]
        if d.get("scheduler") is not None:
            if name not in _MODEL_STAGES:
                self.fail(f"{where}.scheduler", f"only {' and '.join(_MODEL_STAGES)} run a scheduler")
            st.scheduler = self.scheduler(d["scheduler"], f"{where}.scheduler")
        if d.get("max_ongoing_requests") is not None:
            st.max_ongoing_requests = self.number(d["max_ongoing_requests"], f"{where}.max_ongoing_requests",
                                                  integer=True, minimum=1)
        if d.get("torch_threads") is not None:
            st.torch_threads = self.number(d["torch_threads"], f"{where}.torch_threads", integer=True, minimum=1)
        if d.get("ray_actor_options") is not None:
            opts = d["ray_actor_options"]
            if not isinstance(opts, dict):
                self.fail(f"{where}.ray_actor_options", "must be a mapping", opts)
            clash = sorted({"num_cpus", "num_gpus"} & set(opts))
            if clash:
                self.fail(f"{where}.ray_actor_options", f"set {', '.join(clash)} on the stage itself")
            st.ray_actor_options = dict(opts)
        return st

    def autoscaling(self, v, where: str) -> dict:
        if not isinstance(v, dict):
            self.fail(where, "must be a mapping (Ray Serve autoscaling_config)", v)
        lo = self.number(v.get("min_replicas", 1), f"{where}.min_replicas", integer=True)
        hi = self.number(v.get("max_replicas", max(lo, 1)), f"{where}.max_replicas", integer=True, minimum=1)
        if lo > hi:
            self.fail(where, f"min_replicas {lo} > max_replicas {hi}")
        return dict(v)

    def scheduler(self, v, where: str) -> dict:
        from ..scheduling.scheduler import SchedulerConfig

        names = [f.name for f in dataclasses.fields(SchedulerConfig)]
        self.mapping(v, where, names)
        try:
            SchedulerConfig(**v)
        except InputError as e:
            self.fail(where, str(e))
        return dict(v)
