"""The voice-agent bench (tools/bench/agent.py): the session plan, the playback analysis on hand-made timelines
(which gaps are the server's, which the LLM's), and one small cell through a real uvicorn server over the tiny
model."""
import pytest

from cosytrt.tools.bench.agent import AgentSpec, SessionPlan, SessionRecord, analyse, plan_sessions, summarize_agent


def test_plan_is_seeded_poisson_within_the_window():
    spec = AgentSpec(rate=2.0, duration_s=10.0, seed=3)
    a, b = plan_sessions(spec), plan_sessions(spec)
    assert a == b  # dataclass equality: arrivals, sentences, forced tokens, seeds
    assert 5 <= len(a) <= 40 and all(0 < p.arrival < 10 for p in a)
    assert all(x.arrival < y.arrival for x, y in zip(a, a[1:]))
    assert all(2 <= len(p.sentences) <= 5 and all(s.endswith(".") for s in p.sentences) for p in a)
    assert all(round(1.5 * 25) <= p.force_tokens <= round(4.0 * 25) for p in a)


def _rec(text_complete, chunks):
    r = SessionRecord(SessionPlan(0.0, ["a."] * len(text_complete), 50, 0), list(text_complete), chunks, None, True)
    return r


def test_analyse_separates_server_stalls_from_llm_gaps():
    # sentence 0: text at 0.0, chunks at 0.5 (1 s) and 1.2 (1 s) -> plays 0.5..2.5, no gap
    # sentence 1: text complete at 1.0 (before playback ran dry at 2.5), first chunk at 3.0 -> avoidable 0.5 s
    # sentence 2: text complete at 6.0 (after playback ran dry at 4.0), first chunk at 6.4 -> LLM-bound 2.0 s
    r = _rec([0.0, 1.0, 6.0], [(0.5, 1.0, 0), (1.2, 1.0, 0), (3.0, 1.0, 1), (6.4, 1.0, 2)])
    a = analyse(r)
    assert a["sentence_ttfa"] == pytest.approx([0.5, 2.0, 0.4])
    assert a["stalls"] == 1 and a["stall_s"] == pytest.approx(0.5)
    assert a["text_bound_s"] == pytest.approx(2.0)
    assert a["audio_s"] == pytest.approx(4.0)
    # a late chunk inside a sentence is the server's too
    r = _rec([0.0], [(0.2, 0.5, 0), (1.0, 0.5, 0)])
    assert analyse(r)["stalls"] == 1 and analyse(r)["stall_s"] == pytest.approx(0.3)
    s = summarize_agent([r, SessionRecord(SessionPlan(1.0, ["a."], 10, 0), error="boom")], wall_s=2.0)
    assert s["sessions"] == 2 and s["completed"] == 1 and s["failed"] == 1 and s["stalled_sessions"] == 1
    assert s["audio_s_per_s"] == pytest.approx(0.5) and s["errors"] == ["boom"]


def test_agent_cell_through_a_real_server(tiny_tts):
    pytest.importorskip("uvicorn")
    pytest.importorskip("websockets")
    from cosytrt.tools.bench.agent import run_agent_cell

    spec = AgentSpec(rate=1.0, duration_s=2.5, seed=1, sentences=(2, 2), words=(3, 4), sentence_s=(0.4, 0.6),
                     words_per_s=40.0)
    n = len(plan_sessions(spec))
    assert n >= 1
    cell = run_agent_cell(tiny_tts, spec, {"ws_lookahead": 1}, "ws_lookahead=1", timeout_s=60.0)
    assert cell["setting"] == "ws_lookahead=1"
    assert cell["sessions"] == n and cell["completed"] == n and cell["failed"] == 0, cell["errors"]
    assert cell["sentence_ttfa"]["n"] == 2 * n and cell["sentence_ttfa"]["p50"] > 0
    assert cell["audio_s"] == pytest.approx(sum(2 * p.force_tokens / 25 for p in plan_sessions(spec)), rel=1e-3)
    assert set(cell["busy"]) == {"ar", "dit", "hift"} and cell["busy"]["ar"] > 0  # the stages' share of the cell
    assert cell["gil_wait_ms"]["n"] > 0
    from cosytrt.tools.bench.report import agent_tables

    assert "GIL wait" in agent_tables({"agent": {"cells": [cell]}})


def test_parse_settings():
    from cosytrt.tools.bench.agent import parse_settings

    assert parse_settings("ws_lookahead=0,ws_lookahead=2+ws_buffer_hints=0") == [
        ("ws_lookahead=0", {"ws_lookahead": 0}), ("ws_lookahead=2+ws_buffer_hints=0",
                                                  {"ws_lookahead": 2, "ws_buffer_hints": False})]
    for bad in ("nope=1", "ws_lookahead=x", "host=1", ""):
        with pytest.raises(ValueError):
            parse_settings(bad)
