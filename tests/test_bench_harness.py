"""`trtbuild bench` on the CPU: the serving / features harness itself (tiny model, smoke cells), its results JSON
and the report (tables, same-run ratios, PNGs). GPU numbers come from the device runs in BENCHMARKS.md."""
from __future__ import annotations

import json

import pytest

from cosytrt.tools.bench import report as bench_report
from cosytrt.tools.bench.serving import FEATURES, comparison_cells, full_matrix
from cosytrt.tools.trtbuild import main


def test_full_matrix_is_the_issue_matrix():
    cells = full_matrix()
    assert len(cells) == 3 * 4 * 2 * 2 and len(set(cells)) == len(cells)
    assert {c.text for c in cells} == {"short", "medium", "long"}
    assert {c.concurrency for c in cells} == {1, 8, 32, 64}
    assert {(c.stream, c.reference_audio) for c in cells} == {(True, True), (True, False), (False, True),
                                                              (False, False)}
    assert set(comparison_cells()) <= set(cells)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, one_torch_thread):
    out = tmp_path_factory.mktemp("bench")
    assert main(["bench", "--device", "cpu", "--model", "tiny", "--dtype", "float32", "--suite", "serving,features",
                 "--cells", "smoke", "--variants", "eager", "--out", str(out)]) == 0
    return out, json.loads((out / "results.json").read_text())


def test_smoke_run_writes_every_cell_and_feature(smoke):
    _, res = smoke
    cells = res["serving"]["cells"]
    assert [c["variant"] for c in cells] == ["eager", "eager"] and not any("error" in c for c in cells)
    for c in cells:
        assert c["audio_s"] == pytest.approx(2 * 125 / 25)  # two requests of 125 forced tokens
        assert len(c["ttfa_samples"]) == 2 and c["ttfa"]["p50"] > 0 and c["throughput_audio_s_per_s"] > 0
        for k in ("T_tokenizer", "T_AR", "T_DiT", "T_vocoder", "T_queue"):
            assert c[k] >= 0
        # each stage was busy for part of the cell (CPU: wall time of its batches, one worker thread each)
        assert set(c["occupancy"]) == {"ar", "dit", "hift"}
        assert all(0 < v <= 1.0 for v in c["occupancy"].values())
    assert cells[1]["reference_audio"] and cells[1]["T_tokenizer"] > cells[0]["T_tokenizer"]
    labels = [c["variant"] for c in res["features"]["cells"]]
    assert labels == [x for x in ["all on"] + [f"{f} off" for f in FEATURES] + ["all on (repeat)"] for _ in range(2)]


def test_report_tables_ratios_and_plots(smoke, tmp_path):
    out, res = smoke
    import sys

    argv, sys.argv = sys.argv, ["bench_report", str(out / "results.json"), "--out", str(tmp_path)]
    try:
        assert bench_report.main() == 0
    finally:
        sys.argv = argv
    md = (tmp_path / "bench_tables.md").read_text()
    assert "Serving matrix" in md and "Scheduler features off vs on" in md
    assert "What each feature buys" in md and md.count("continuous_batching off") >= 3
    assert "| AR busy | DiT busy | HiFT busy |" in md and md.count("all on, repeat vs first (noise)") == 2
    assert (tmp_path / "bench_serving.png").stat().st_size > 0


def test_micro_suites_need_cuda(tmp_path, capsys):
    assert main(["bench", "--device", "cpu", "--model", "tiny", "--suite", "dit", "--out", str(tmp_path)]) == 2
    assert "need --device cuda" in capsys.readouterr().err


def test_unknown_suite_and_variant_are_errors(tmp_path, capsys):
    assert main(["bench", "--device", "cpu", "--suite", "serve", "--out", str(tmp_path)]) == 2
    assert "unknown bench suite" in capsys.readouterr().err
    assert main(["bench", "--device", "cpu", "--suite", "serving", "--variants", "fast", "--out", str(tmp_path)]) == 2
    assert "unknown serving variant" in capsys.readouterr().err


def test_features_suite_alone_runs_no_matrix_cells(tmp_path, one_torch_thread):
    assert main(["bench", "--device", "cpu", "--model", "tiny", "--dtype", "float32", "--suite", "features",
                 "--cells", "smoke", "--variants", "eager", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["serving"]["cells"] == [] and len(res["features"]["cells"]) == 2 * (2 + len(FEATURES))


def test_report_of_ar_micro_rows(tmp_path):
    """The AR micro rows as the GPU run writes them (decode with its kernel table, prefill with graph columns)."""
    kernels = {"kernel_us": 812.0, "launches": 290.0,
               "top": [{"name": "triton_red_fused_mul_sum_0", "calls": 24.0, "us": 150.5},
                       {"name": "sm90_xmma_gemm_bf16bf16", "calls": 96.0, "us": 420.25}]}
    res = {"ar": [{"stage": "ar_decode", "batch": 2, "kv_len": 1024, "eager_ms": 15.0, "graph_ms": 3.0,
                   "compiled_sdpa_graph_ms": 1.7, "compiled_graph_ms": 1.2, "bound_ms": 0.15,
                   "best_fraction_of_bound": 0.125, "compiled_max_abs_err": 0.03, "kernels": kernels},
                  {"stage": "ar_prefill", "batch": 2, "tokens": 150, "eager_ms": 14.0, "graph_ms": 2.5,
                   "compiled_ms": 7.0, "compiled_graph_ms": 1.1, "bound_ms": 0.4, "compiled_max_abs_err": 0.02}]}
    md = bench_report.tables(res)
    assert "| 2 | 15 | 3 | 1.7 | 1.2 |" in md.replace(".0 |", " |")
    assert "AR decode kernels, batch 2** (compiled, no graph; per step: 290 launches, 812 us" in md
    assert "triton_red_fused_mul_sum_0" in md
    assert "compiled + graph | bound" in md  # the prefill table has the graph columns
    assert bench_report.plots(res, str(tmp_path)) == [str(tmp_path / "bench_micro.png")]


def test_aoti_child_builds_loads_and_times_the_dit(tmp_path):
    """The AOTInductor DiT variant runs whole in a child process (build, wait, load, time): on the CPU with the tiny
    model it returns one row per shape, matching the eager DiT."""
    import torch

    from cosytrt.tools.bench.aoti import AotiBuild

    child = AotiBuild("tiny", torch.float32, "cpu", str(tmp_path))
    got = child.measure([(2, 40), (4, 64)])
    assert got["build_s"] > 0
    assert [(r["rows"], r["frames"]) for r in got["rows"]] == [(2, 40), (4, 64)]
    for r in got["rows"]:
        assert r["aoti_graph_ms"] > 0 and r["aoti_graph_max_abs_err"] <= 1e-4


def test_aoti_child_failure_is_an_error_with_its_log(tmp_path):
    import torch

    from cosytrt.tools.bench.aoti import AotiBuild

    child = AotiBuild("tiny", torch.float32, "no-such-device", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"AOTInductor DiT child exited with 1 .*\n(.|\n)*Traceback"):
        child.measure([(2, 40)])


def test_hift_micro_rows_and_report(tiny_tts, monkeypatch, tmp_path):
    """`bench_hift` on the CPU (tiny HiFT; CUDA timing and graphs replaced by direct calls; the compiled column is
    left out: compiling even the tiny HiFT takes minutes on 2 cores), and its report table."""
    from cosytrt.engines import cuda_graphs
    from cosytrt.tools.bench import micro, timing

    class Direct:
        def __init__(self, fn, device):
            self.fn = fn

        def capture(self, key, inputs):
            pass

        def run(self, key, *inputs):
            return self.fn(*inputs)

    monkeypatch.setattr(cuda_graphs, "GraphCache", Direct)
    for module in (micro, timing):  # micro times eager calls; timing.graph_timing times the graph replays
        monkeypatch.setattr(module, "time_cuda", lambda fn, reps=10, warmup=2: (fn(), 2.0)[1])
    rows = micro.bench_hift(tiny_tts.pipeline.models.hift, "cpu", quick=True, compile=False)
    assert [(r["batch"], r["frames"]) for r in rows] == [(1, 100), (2, 500), (8, 500)]
    assert all(r["graph_ms"] == 2.0 and "compiled_graph_ms" not in r for r in rows)
    assert rows[2]["ms_per_audio_s"] == pytest.approx(2.0 / (8 * 500 * 480 / 24000))
    rows[2].update(compiled_graph_ms=1.0, compiled_max_abs_err=3e-6)
    md = bench_report.tables({"hift": rows})
    assert "| compiled + graph ms |" in md and "| 8 | 500 | 2 | 2 | 1 |" in md.replace(".0 |", " |")


def test_engines_variant_serves_from_an_engine_set_of_the_same_weights(tmp_path, one_torch_thread):
    """`--variants engines --engines DIR`: the serving cells run the DiT / HiFT through an engine set built from the
    bench's own seeded weights (here an ONNX Runtime set of the tiny bench model on the CPU; on the GPU machine one
    built with `trtbuild build --model random-full --backend onnxruntime --device cuda`); without --engines, an error."""
    import torch

    from cosytrt.build.engine_set import build_engine_set
    from cosytrt.runtime.stages.profile import load_profile
    from cosytrt.tools.bench.common import full_models, random_models

    es = tmp_path / "es"
    build_engine_set(random_models(*full_models("cpu", torch.float32, "tiny"), "tiny"), load_profile("tiny"),
                     "onnxruntime", "cpu", str(es), progress=False)
    out = tmp_path / "out"
    assert main(["bench", "--device", "cpu", "--model", "tiny", "--dtype", "float32", "--suite", "serving",
                 "--cells", "smoke", "--variants", "engines", "--engines", str(es), "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    cells = res["serving"]["cells"]
    assert cells and all(c["variant"] == "engines" and "error" not in c for c in cells), res["serving"]
    assert main(["bench", "--device", "cpu", "--model", "tiny", "--suite", "serving", "--variants", "engines",
                 "--out", str(tmp_path / "x")]) == 2
