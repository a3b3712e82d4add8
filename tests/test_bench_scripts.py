"""benchmarks/batch_invariance_gpu.py (issue #20's GPU check) runs as one command and writes its JSON summary: its
CPU smoke mode (tiny model, eager, no CUDA) exercises the wiring the GPU run uses. The GPU numbers themselves come
from the coordinator's device run (BENCHMARKS.md)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "batch_invariance_gpu.py")


def _run(*args, env=None):
    e = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300, env=e,
                          cwd=ROOT)


def test_smoke_writes_the_json_summary(tmp_path):
    p = _run("--smoke", "--parts", "logits", env={"OUT": str(tmp_path)})  # the folder from $OUT
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path / "batch_invariance.json").read_text())
    assert res["status"] == "complete" and res["errors"] == {} and res["meta"]["commit"]
    assert res["summary"]["logits_on_invariant"] is True            # on: bit-identical rows on the CPU
    assert "logits" in res["parts_s"] and (tmp_path / "batch_invariance.md").is_file()


def test_budget_skips_parts_and_bad_arguments_fail(tmp_path):
    p = _run(str(tmp_path), "--smoke", "--parts", "logits", "--budget-s", "0")
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "batch_invariance.json").read_text())
    assert res["status"] == "partial" and res["skipped"] == ["logits"]
    p = _run(str(tmp_path), "--smoke", "--parts", "nope")
    assert p.returncode == 2 and "unknown part" in p.stderr


@pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="needs bash")
def test_the_one_command_wrappers_are_valid_bash():
    for name in ("batch_invariance_run.sh", "device_run.sh", "session15_call.sh", "open_loop_old_new.sh",
                 "session19_call.sh", "bench_job.sh"):
        assert subprocess.run(["bash", "-n", os.path.join(ROOT, "benchmarks", name)]).returncode == 0, name


def test_dit_shapes_smoke_and_conv_variants_equal(tmp_path):
    """tools/bench/dit_shapes.py on the CPU (tiny model, eager), whole streaming calls and a prefix-cached hop: every
    convolution variant it times computes the model's convolution (max |diff| to F.conv1d within fp32 rounding), and
    the report files are written. The implementations are runtime/models/dit_conv.py's (tests/test_flow.py checks
    them inside the DiT)."""
    import json

    from cosytrt.tools.bench import dit_shapes

    assert dit_shapes.main(["--out", str(tmp_path), "--smoke", "--lengths", "40", "--reps", "1",
                            "--modes", "stream,cached", "--cached-shapes", "50:100"]) == 0
    res = json.loads((tmp_path / "dit_shapes.json").read_text())
    assert [(r["mode"], r["T"]) for r in res["rows"]] == [("stream", 40), ("cached", "50+100")]
    cpu = [n for n in dit_shapes.VARIANTS if n not in dit_shapes.CUDA_ONLY]
    for row in res["rows"]:
        for name in cpu:
            assert row[name] is not None, (row["mode"], row.get(f"{name}_error"))
        for name in cpu[1:]:
            assert row[f"{name}_err"] < 1e-4, (row["mode"], name)
    assert (tmp_path / "dit_shapes.md").read_text().count("| stream | 40 |") == 1


def test_smoke_token_check_streams_with_scheduler_overrides(tmp_path):
    """The token check with streaming requests and SchedulerConfig overrides (the GPU exactness check of the DiT /
    HiFT scheduling paths): on the CPU, step-level and whole-call DiT scheduling both give 16 of 16 the tokens and
    audio they give alone."""
    for sched in ("dit_step_level=1,hift_own_stream=1", "dit_step_level=0"):
        p = _run(str(tmp_path), "--smoke", "--parts", "tokens", "--stream", "--sched", sched)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        res = json.loads((tmp_path / "batch_invariance.json").read_text())
        row = res["tokens"][0]
        on = sched.startswith("dit_step_level=1")
        assert row["same_tokens"] == 16 and "streaming" in row["path"] and f"dit_step_level={on}" in row["path"]
        assert row["audio_max_abs_diff_same_tokens"] <= 2e-3
        kinds = row["stats_dit_kinds"]
        assert any(k.endswith("/step") for k in kinds) == on, kinds


def test_old_open_loop_harness_drives_and_summarises(tmp_path):
    """benchmarks/old_open_loop.py (the #18 baseline of an old wheel under HEAD's open-loop cell): arrivals submitted
    at their times, chunk times and sizes recorded as HEAD's playback summary reads them, a request still running at
    the end of the cell cancelled and counted unfinished, a refused submit counted failed. A fake TTS stands in for
    the old wheel's (the GPU run is BENCHMARKS.md's)."""
    import importlib.util
    import threading
    import time as _time

    import numpy as np

    spec = importlib.util.spec_from_file_location("old_open_loop", os.path.join(ROOT, "benchmarks", "old_open_loop.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    pb = mod.load_playback()

    class Metrics:
        def __init__(self):
            self.t_submit, self.chunk_times, self.ttfa = _time.perf_counter(), [], None

    class Handle:
        def __init__(self, n_chunks, gap):
            self.metrics, self.error, self._chunks = Metrics(), None, []
            self._done, self._cancelled = threading.Event(), False

            def run():
                for _ in range(n_chunks):
                    _time.sleep(gap)
                    if self._cancelled:
                        break
                    self.metrics.chunk_times.append(_time.perf_counter() - self.metrics.t_submit)
                    self.metrics.ttfa = self.metrics.ttfa or self.metrics.chunk_times[0]
                    self._chunks.append(np.zeros(2400, np.float32))  # 0.1 s at 24 kHz
                if self._cancelled:
                    self.error = RuntimeError("cancelled")
                self._done.set()
            threading.Thread(target=run, daemon=True).start()

        def result(self, timeout=None):
            if not self._done.wait(timeout):
                raise TimeoutError
            if self.error:
                raise self.error

        def cancel(self):
            self._cancelled = True
            self._done.wait(2)

        def chunks(self, timeout=None):
            yield from self._chunks
            if self.error:
                raise self.error

    class FakeTTS:
        sample_rate = 24000

        def submit(self, req):
            if req == "refuse":
                raise ValueError("busy")
            return Handle(*req)

    arrivals = [{"t": 0.0, "tokens": 5, "stream": True, "seed": 0},
                {"t": 0.05, "tokens": 5, "stream": True, "seed": 1},
                {"t": 0.1, "tokens": 50, "stream": True, "seed": 2},
                {"t": 0.1, "tokens": 5, "stream": True, "seed": 3}]
    reqs = {0: (2, 0.02), 1: (2, 0.02), 2: (50, 0.05), 3: "refuse"}
    cells = mod.run_cells(FakeTTS(), [{"rate": 4, "arrivals": arrivals}], 0.3, 0.3, lambda a: reqs[a["seed"]], pb,
                          log=lambda m: None)
    c = cells[0]
    st = [r["status"] for r in c["records"]]
    assert st == [pb.OK, pb.OK, pb.UNFINISHED, pb.FAILED], st
    assert c["completed"] == 2 and c["unfinished"] == 1 and c["failed"] == 1
    first = c["records"][0]
    assert len(first["chunk_t"]) == 2 and first["chunk_s"] == [0.1, 0.1]
    assert 0.0 < first["chunk_t"][0] < first["chunk_t"][1] < 0.3
    assert c["ttfa"]["p50"] is not None and c["saturated"]  # one request unfinished behind its listener
