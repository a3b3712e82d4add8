"""Bucket profiles: the YAML that says which engine shapes to build and which buckets the runtime may use.

The layout is documented at the top of profiles/default.yaml. `load_profile("default" | "tiny" | path)` reads and
validates one; every problem raises ProfileError naming the file, the key path and the value.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import yaml

from ...engines.buckets import (CFG_ROWS, DEFAULT_MAX_PADDING_WASTE, STAGE_MODES, STAGES, Bucket, BucketTable,
                      check_stage_mode)
from ..models.config import CosyVoice3Config, full_config, tiny_config
from ...engines.errors import ProfileError

from ...engines.dtypes import DTYPES  # noqa: E402
MODELS = ("full", "tiny")
SHIPPED_PROFILES = ("default", "tiny", "h200-graphs", "h200-open-loop", "h200-cached-open-loop",
                    "h200-cached-open-loop-b16", "h200-mixed")
PROFILE_FORMAT = 1  # bump when the meaning of a profile (and so of its hashes) changes

_TOP_KEYS = ("model", "description", "dtype", "max_padding_waste", "stages")
_COMMON_STAGE_KEYS = ("dtype", "max_padding_waste", "options")
_STAGE_KEYS = {
    "dit": _COMMON_STAGE_KEYS + ("stream", "offline", "cached"),
    "hift": _COMMON_STAGE_KEYS + ("allow_reduced_precision", "stream", "offline"),
    "ar": _COMMON_STAGE_KEYS + ("max_seq_len", "decode_batch", "prefill"),
}
# length key (and its dynamic lower bound) of each stage's mode sections
_LEN_KEY = {"dit": ("frames", "min_frames"), "hift": ("frames", "min_frames"), "ar": ("tokens", "min_tokens")}


@dataclass(frozen=True)
class StageProfile:
    """One stage of a profile: its engine dtype, options and buckets per mode (each tuple sorted by cost)."""
    stage: str
    dtype: str
    max_padding_waste: float
    modes: dict[str, tuple[Bucket, ...]]
    options: dict[str, Any] = field(default_factory=dict)
    allow_reduced_precision: bool = False
    max_seq_len: int | None = None  # ar only: the KV length of every decode bucket
    cached: Any = None  # dit only: the CachedGrid of prefix-cached hop graphs (stages/flow_hop_calls.py), or None

    def buckets(self, mode: str) -> list[Bucket]:
        check_stage_mode(self.stage, mode)
        return list(self.modes.get(mode, ()))

    def all_buckets(self) -> list[Bucket]:
        return [bk for m in STAGE_MODES[self.stage] for bk in self.modes.get(m, ())]


@dataclass(frozen=True)
class Profile:
    model: str
    dtype: str
    max_padding_waste: float
    stages: dict[str, StageProfile]
    description: str = ""
    source: str = field(default="<dict>", compare=False)

    def stage(self, name: str) -> StageProfile | None:
        """The stage's profile, or None when the profile builds nothing for it."""
        if name not in STAGE_MODES:
            check_stage_mode(name, "")  # raises: unknown stage
        return self.stages.get(name)

    @property
    def cached_grid(self):
        """The DiT's cached-hop grid (`dit.cached`, a CachedGrid), or None."""
        sp = self.stages.get("dit")
        return sp.cached if sp is not None else None

    def buckets(self, stage: str, mode: str) -> list[Bucket]:
        """Buckets of (stage, mode) sorted by cost (batch x length); [] when the profile has none."""
        check_stage_mode(stage, mode)
        sp = self.stages.get(stage)
        return sp.buckets(mode) if sp else []

    def table(self, stage: str, mode: str) -> BucketTable:
        """A BucketTable of (stage, mode) with the stage's max_padding_waste."""
        sp = self.stages.get(stage)
        waste = sp.max_padding_waste if sp else self.max_padding_waste
        return BucketTable(self.buckets(stage, mode), max_padding_waste=waste)

    def all_buckets(self) -> list[Bucket]:
        return [bk for s in STAGES if s in self.stages for bk in self.stages[s].all_buckets()]

    def model_config(self) -> CosyVoice3Config:
        return full_config() if self.model == "full" else tiny_config()

    def to_dict(self) -> dict[str, Any]:
        """Normalised plain dict in the YAML layout (explicit bucket lists, resolved dtypes); loads back equal."""
        d: dict[str, Any] = {"model": self.model}
        if self.description:
            d["description"] = self.description
        d.update(dtype=self.dtype, max_padding_waste=self.max_padding_waste, stages={})
        for s in STAGES:
            sp = self.stages.get(s)
            if sp is None:
                continue
            sd: dict[str, Any] = {"dtype": sp.dtype, "max_padding_waste": sp.max_padding_waste,
                                  "options": json.loads(json.dumps(sp.options))}
            if s == "hift":
                sd["allow_reduced_precision"] = sp.allow_reduced_precision
            lk, mk = _LEN_KEY[s]
            if s == "ar":
                sd["max_seq_len"] = sp.max_seq_len
                if "decode" in sp.modes:
                    sd["decode_batch"] = [bk.batch for bk in sp.modes["decode"]]
                if "prefill" in sp.modes:
                    sd["prefill"] = {"buckets": [_bucket_entry(bk, lk, mk) for bk in sp.modes["prefill"]]}
            else:
                for m in STAGE_MODES[s]:
                    if m in sp.modes:
                        sd[m] = {"buckets": [_bucket_entry(bk, lk, mk) for bk in sp.modes[m]]}
            if sp.cached is not None:
                sd["cached"] = sp.cached.to_dict()
            d["stages"][s] = sd
        return d

    def profile_hash(self, stage: str | None = None) -> str:
        """Stable hex digest for incremental builds.

        No stage: everything the profile defines (description excluded). With a stage: only what changes that
        stage's engines (model, dtype, options, bucket shapes, AR max_seq_len), so editing another stage or a
        runtime-only setting (max_padding_waste) keeps it."""
        if stage is None:
            payload = self.to_dict()
            payload.pop("description", None)
        else:
            sp = self.stages.get(stage)
            if stage not in STAGE_MODES:
                check_stage_mode(stage, "")
            payload = None if sp is None else {
                "model": self.model, "stage": stage, "dtype": sp.dtype, "options": sp.options,
                "max_seq_len": sp.max_seq_len, "buckets": [bk.key for bk in sp.all_buckets()]}
        return _digest({"format": PROFILE_FORMAT, "profile": payload})

    def bucket_hash(self, bucket: Bucket) -> str:
        """Digest of one engine shape: model, stage dtype/options, AR max_seq_len and the bucket key."""
        sp = self.stages.get(bucket.stage)
        if sp is None or bucket not in sp.modes.get(bucket.mode, ()):
            raise ProfileError(f"{self.source}: bucket {bucket.key} is not in this profile")
        return _digest({"format": PROFILE_FORMAT, "model": self.model, "dtype": sp.dtype, "options": sp.options,
                        "max_seq_len": sp.max_seq_len, "bucket": bucket.key})


def _bucket_entry(bk: Bucket, lk: str, mk: str) -> dict[str, int]:
    e = {"batch": bk.batch, lk: bk.length}
    if bk.min_length > 1:
        e[mk] = bk.min_length
    return e


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------------- loading

class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (PyYAML would keep the last silently)."""


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key, line: int):
        super().__init__(f"line {line}: key {key!r} given twice in one mapping")


def _construct_unique_mapping(loader, node, deep=False):
    seen = set()
    for k, _ in node.value:
        key = loader.construct_object(k, deep=True)
        if key in seen:
            raise _DuplicateKey(key, k.start_mark.line + 1)
        seen.add(key)
    return loader.construct_mapping(node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def load_profile(path_or_name: str | os.PathLike) -> Profile:
    """Load a profile: a shipped name (default, tiny, h200-graphs in cosytrt.profiles) or a YAML file path."""
    if isinstance(path_or_name, Profile):
        return path_or_name
    if not isinstance(path_or_name, (str, os.PathLike)):
        raise ProfileError(f"load_profile needs a profile name or a path, got {path_or_name!r}")
    s = os.fspath(path_or_name)
    if s in SHIPPED_PROFILES:
        res = resources.files("cosytrt.profiles").joinpath(f"{s}.yaml")
        return _load_text(res.read_text(encoding="utf-8"), str(res))
    if not os.path.isfile(s):
        bare = os.sep not in s and "/" not in s and not s.endswith((".yaml", ".yml"))
        hint = f" (shipped profiles: {', '.join(SHIPPED_PROFILES)})" if bare else ""
        raise ProfileError(f"profile file not found: {s}{hint}")
    try:
        with open(s, "rb") as f:
            raw = f.read(MAX_PROFILE_BYTES + 1)
    except OSError as e:
        raise ProfileError(f"profile {s}: cannot read it ({e.strerror or e})") from None
    if len(raw) > MAX_PROFILE_BYTES:
        raise ProfileError(f"profile {s}: larger than {MAX_PROFILE_BYTES // 1024} KiB: not a profile")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProfileError(f"profile {s}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return _load_text(text, s)


def _load_text(text: str, source: str) -> Profile:
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as e:
        raise ProfileError(f"{source}: {e}") from None
    except yaml.YAMLError as e:
        raise ProfileError(f"{source}: not valid YAML ({e})") from None
    except RecursionError:
        raise ProfileError(f"{source}: YAML nested too deeply to be a profile") from None
    return profile_from_dict(data, source)


MAX_PROFILE_BYTES = 1 << 20  # a profile file (the shipped ones are a few KiB)
MAX_LIST = 256            # values in one bucket list (batch, lengths, cached-hop axes; shipped: at most 24)
MAX_MODE_BUCKETS = 2048   # buckets of one stage mode or cached-hop grid (shipped: at most 160; each is an engine
                          # or a graph to build, so a typo'd grid of millions must fail here, not after an hour)
MAX_OPTION_DEPTH = 8      # builder options nest at most this deep
MAX_OPTION_NODES = 10000  # and hold at most this many values (YAML aliases can multiply a small file)


def profile_from_dict(data: Any, source: str = "<dict>") -> Profile:
    """Validate a profile given as plain data (the parsed YAML, or Profile.to_dict())."""
    try:
        return _Parser(source).profile(data)
    except RecursionError:
        raise ProfileError(f"{source}: nested too deeply to be a profile") from None


# ---------------------------------------------------------------------------------------------------- validation

class _Parser:
    def __init__(self, source: str):
        self.source = source

    def fail(self, path: str, msg: str, value: Any = ...):
        got = "" if value is ... else f", got {value!r}"
        raise ProfileError(f"{self.source}: {path}: {msg}{got}")

    def mapping(self, v, path: str, allowed) -> dict:
        if not isinstance(v, dict):
            self.fail(path, "must be a mapping", v)
        for k in v:
            if not isinstance(k, str):
                self.fail(path, "keys must be strings", k)
            if k not in allowed:
                self.fail(f"{path}.{k}" if path else k, f"unknown key (allowed here: {', '.join(allowed)})")
        return v

    def pos_int(self, v, path: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(path, "must be a positive integer", v)
        if v < 1:
            self.fail(path, "must be a positive integer", v)
        return v

    def int_list(self, v, path: str) -> list[int]:
        if not isinstance(v, list):
            self.fail(path, "must be a list of positive integers", v)
        if not v:
            self.fail(path, "is empty")
        if len(v) > MAX_LIST:
            self.fail(path, f"has {len(v)} values; at most {MAX_LIST}")
        seen: set[int] = set()
        for i, x in enumerate(v):
            x = self.pos_int(x, f"{path}[{i}]")
            if x in seen:
                self.fail(f"{path}[{i}]", "duplicate value", x)
            seen.add(x)
        return sorted(seen)

    def grid_size(self, path: str, *axes) -> None:
        n = math.prod(len(a) for a in axes)
        if n > MAX_MODE_BUCKETS:
            self.fail(path, f"makes {n} buckets; at most {MAX_MODE_BUCKETS} per mode")

    def dtype(self, v, path: str) -> str:
        if v not in DTYPES or not isinstance(v, str):
            self.fail(path, f"unsupported dtype (choose {', '.join(DTYPES)})", v)
        return v

    def waste(self, v, path: str) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            self.fail(path, "must be a number >= 1", v)
        if v < 1:
            self.fail(path, "must be >= 1 (padded work / real work can not be below 1)", v)
        return float(v)

    def options(self, v, path: str) -> dict:
        if not isinstance(v, dict):
            self.fail(path, "must be a mapping of builder options", v)

        seen = [0]

        def check(x, p, depth=0):
            seen[0] += 1
            if depth > MAX_OPTION_DEPTH:
                self.fail(p, f"options nest deeper than {MAX_OPTION_DEPTH} levels")
            if seen[0] > MAX_OPTION_NODES:
                self.fail(path, f"more than {MAX_OPTION_NODES} option values")
            if isinstance(x, dict):
                for k, y in x.items():
                    if not isinstance(k, str):
                        self.fail(p, "option names must be strings", k)
                    check(y, f"{p}.{k}", depth + 1)
            elif isinstance(x, list):
                for i, y in enumerate(x):
                    check(y, f"{p}[{i}]", depth + 1)
            elif not (x is None or isinstance(x, (bool, int, str)) or (isinstance(x, float) and math.isfinite(x))):
                self.fail(p, "option values must be plain numbers, strings, booleans, lists or mappings", x)
        check(v, path)
        return json.loads(json.dumps(v))

    # ------------------------------------------------------------------------------------------------ structure
    def profile(self, data) -> Profile:
        if data is None:
            self.fail("(top level)", "profile is empty")
        if not isinstance(data, dict):
            self.fail("(top level)", "must be a mapping", data)
        d = self.mapping(data, "", _TOP_KEYS)
        if "model" not in d:
            self.fail("model", f"missing (choose {', '.join(MODELS)})")
        model = d["model"]
        if not isinstance(model, str) or model not in MODELS:
            self.fail("model", f"unknown model (choose {', '.join(MODELS)})", model)
        desc = d.get("description", "")
        if not isinstance(desc, str):
            self.fail("description", "must be a string", desc)
        dtype = self.dtype(d["dtype"], "dtype") if "dtype" in d else "float32"
        waste = self.waste(d["max_padding_waste"], "max_padding_waste") if "max_padding_waste" in d \
            else DEFAULT_MAX_PADDING_WASTE
        if "stages" not in d:
            self.fail("stages", f"missing (give at least one of {', '.join(STAGES)})")
        stages_d = self.mapping(d["stages"], "stages", STAGES)
        if not stages_d:
            self.fail("stages", f"no stages (give at least one of {', '.join(STAGES)})")
        cfg = full_config() if model == "full" else tiny_config()
        stages = {s: self.stage(s, stages_d[s], f"stages.{s}", dtype, waste, cfg) for s in STAGES if s in stages_d}
        return Profile(model=model, dtype=dtype, max_padding_waste=waste, stages=stages, description=desc,
                       source=self.source)

    def stage(self, s: str, v, path: str, top_dtype: str, top_waste: float, cfg: CosyVoice3Config) -> StageProfile:
        if v is None or v == {}:
            self.fail(path, "empty stage (give its buckets, or leave the stage out)")
        d = self.mapping(v, path, _STAGE_KEYS[s])
        waste = self.waste(d["max_padding_waste"], f"{path}.max_padding_waste") if "max_padding_waste" in d \
            else top_waste
        options = self.options(d["options"], f"{path}.options") if "options" in d else {}
        allow = False
        if s == "hift":
            allow = d.get("allow_reduced_precision", False)
            if not isinstance(allow, bool):
                self.fail(f"{path}.allow_reduced_precision", "must be true or false", allow)
            # HiFT does not inherit the top-level dtype: a reduced-precision vocoder is audible
            dtype = self.dtype(d["dtype"], f"{path}.dtype") if "dtype" in d else "float32"
            if dtype != "float32" and not allow:
                self.fail(f"{path}.dtype", "HiFT must run in float32 (reduced precision is audible); set "
                          "allow_reduced_precision: true to override", dtype)
        else:
            dtype = self.dtype(d["dtype"], f"{path}.dtype") if "dtype" in d else top_dtype

        modes: dict[str, tuple[Bucket, ...]] = {}
        max_seq_len = None
        if s == "ar":
            if "max_seq_len" not in d:
                self.fail(f"{path}.max_seq_len", "missing (the KV length of the AR engines)")
            max_seq_len = self.pos_int(d["max_seq_len"], f"{path}.max_seq_len")
            limit = cfg.llm.qwen.max_position_embeddings
            if max_seq_len > limit:
                self.fail(f"{path}.max_seq_len", f"exceeds the {cfg.name} model's max_position_embeddings "
                          f"{limit}", max_seq_len)
            if "decode_batch" in d:
                batches = self.int_list(d["decode_batch"], f"{path}.decode_batch")
                modes["decode"] = self.finish([(Bucket("ar", "decode", b, max_seq_len), f"{path}.decode_batch")
                                               for b in batches], f"{path}.decode_batch")
            if "prefill" in d:
                modes["prefill"] = self.mode(s, "prefill", d["prefill"], f"{path}.prefill", max_seq_len,
                                             "max_seq_len")
        else:
            limit = (cfg.flow if s == "dit" else cfg.hift).max_mel_frames
            for m in STAGE_MODES[s]:
                if m in d:
                    modes[m] = self.mode(s, m, d[m], f"{path}.{m}", limit, f"the {cfg.name} model's noise buffer")
        cached = self.cached_grid(d["cached"], f"{path}.cached", cfg) if "cached" in d else None
        if not modes:
            modes_keys = ("decode_batch", "prefill") if s == "ar" else STAGE_MODES[s]
            self.fail(path, f"empty stage: no buckets (give {' and/or '.join(modes_keys)})")
        return StageProfile(stage=s, dtype=dtype, max_padding_waste=waste, modes=modes, options=options,
                            allow_reduced_precision=allow, max_seq_len=max_seq_len, cached=cached)

    def cached_grid(self, v, path: str, cfg: CosyVoice3Config):
        """dit.cached: {batch: [requests], frames: [new frames], prefix: [cached frames, 0 allowed]}."""
        from .flow_hop_calls import CachedGrid

        d = self.mapping(v, path, ("batch", "frames", "prefix"))
        for k in ("batch", "frames", "prefix"):
            if k not in d:
                self.fail(f"{path}.{k}", "missing (cached hop grid: batch, frames and prefix lists)")
        prefix = d["prefix"]
        if not isinstance(prefix, list) or not prefix or any(not isinstance(p, int) or isinstance(p, bool) or p < 0
                                                            for p in prefix):
            self.fail(f"{path}.prefix", "must be a non-empty list of integers >= 0", prefix)
        if len(prefix) > MAX_LIST:
            self.fail(f"{path}.prefix", f"has {len(prefix)} values; at most {MAX_LIST}")
        grid = CachedGrid(tuple(self.int_list(d["batch"], f"{path}.batch")),
                          tuple(self.int_list(d["frames"], f"{path}.frames")), tuple(prefix))
        self.grid_size(path, grid.batch, grid.frames, grid.prefix)
        limit = cfg.flow.max_mel_frames
        if max(grid.frames) + max(grid.prefix) > limit:
            self.fail(path, f"largest frames + prefix {max(grid.frames) + max(grid.prefix)} exceeds the {cfg.name} "
                      f"model's noise buffer ({limit} frames)")
        return grid

    def mode(self, s: str, m: str, v, path: str, max_len: int, max_what: str) -> tuple[Bucket, ...]:
        lk, mk = _LEN_KEY[s]
        if v is None:
            self.fail(path, f"no buckets (give batch + {lk}, or buckets)")
        d = self.mapping(v, path, ("batch", lk, "buckets"))
        items: list[tuple[Bucket, str]] = []
        if "batch" in d or lk in d:
            for k in ("batch", lk):
                if k not in d:
                    self.fail(f"{path}.{k}", f"missing (batch and {lk} go together: their product is the grid)")
            batches = self.int_list(d["batch"], f"{path}.batch")
            lens = self.int_list(d[lk], f"{path}.{lk}")
            self.grid_size(path, batches, lens)
            for i, b in enumerate(d["batch"]):
                self.check_batch(s, b, f"{path}.batch[{i}]")
            for i, n in enumerate(d[lk]):
                if n > max_len:
                    self.fail(f"{path}.{lk}[{i}]", f"exceeds {max_what} ({max_len})", n)
            items += [(Bucket(s, m, b, n), f"{path} (grid batch {b} x {lk} {n})") for b in batches for n in lens]
        if "buckets" in d:
            lst = d["buckets"]
            if not isinstance(lst, list):
                self.fail(f"{path}.buckets", "must be a list of mappings", lst)
            if not lst:
                self.fail(f"{path}.buckets", "is empty")
            if len(lst) > MAX_MODE_BUCKETS:
                self.fail(f"{path}.buckets", f"has {len(lst)} buckets; at most {MAX_MODE_BUCKETS} per mode")
            for i, e in enumerate(lst):
                p = f"{path}.buckets[{i}]"
                e = self.mapping(e, p, ("batch", lk, mk))
                for k in ("batch", lk):
                    if k not in e:
                        self.fail(f"{p}.{k}", "missing")
                b = self.pos_int(e["batch"], f"{p}.batch")
                self.check_batch(s, b, f"{p}.batch")
                n = self.pos_int(e[lk], f"{p}.{lk}")
                if n > max_len:
                    self.fail(f"{p}.{lk}", f"exceeds {max_what} ({max_len})", n)
                lo = self.pos_int(e[mk], f"{p}.{mk}") if mk in e else 1
                if lo > n:
                    self.fail(f"{p}.{mk}", f"must not exceed {lk} ({n})", lo)
                items.append((Bucket(s, m, b, n, lo), p))
        if not items:
            self.fail(path, f"no buckets (give batch + {lk}, or buckets)")
        return self.finish(items, path)

    def check_batch(self, s: str, b, path: str) -> None:
        if s == "dit" and b % CFG_ROWS:
            self.fail(path, f"DiT batch counts CFG rows ({CFG_ROWS} per request) and must be even", b)

    def finish(self, items: list[tuple[Bucket, str]], path: str) -> tuple[Bucket, ...]:
        where: dict[Bucket, str] = {}
        for bk, p in items:
            if bk in where:
                self.fail(p, f"duplicate bucket {bk.key} (also given at {where[bk]})")
            where[bk] = p
        return tuple(sorted(where, key=lambda x: x.sort_key))
