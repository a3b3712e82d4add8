"""CosyVoice3LM: golden parity, checkpoint layout/validation, static KV cache (prefill/decode, batched slots)."""
import json
import os

import pytest
import torch

from cosytrt.runtime.models.config import config_from_golden_json, full_config
from cosytrt.engines.errors import CheckpointError, InputError
from cosytrt.runtime.models.llm import CosyVoice3LM

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden")
TOL = 1e-4


@pytest.fixture(scope="module")
def vectors(golden_vectors):
    return golden_vectors


@pytest.fixture(scope="module")
def state_dict():
    return torch.load(os.path.join(GOLDEN, "llm.pt"), map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def lm(state_dict):
    m = CosyVoice3LM(config_from_golden_json(os.path.join(GOLDEN, "config.json")).llm).eval()
    m.load_checkpoint(state_dict)
    return m


def _maxerr(a, b):
    return (a - b).abs().max().item()


# ---------------------------------------------------------------- golden parity

def test_golden_hidden_and_logits(lm, vectors):
    with torch.no_grad():
        hidden = lm.forward_hidden(vectors["llm.lm_input"])
        logits = lm.logits(hidden)
    assert hidden.shape == (1, 54, 64) and logits.shape == (1, 54, 6761)
    assert _maxerr(hidden, vectors["llm.hidden"]) <= TOL
    assert _maxerr(logits, vectors["llm.logits"]) <= TOL


def test_build_lm_input_reproduces_golden(lm, vectors):
    with torch.no_grad():
        prompt = lm.build_lm_input(vectors["llm.text"], vectors["llm.prompt_speech"])
        full = torch.cat([prompt, lm.embed_speech(vectors["llm.target_speech"][0])])
    assert prompt.shape == (1 + 23 + 1 + 17, 64)
    assert _maxerr(full, vectors["llm.lm_input"][0]) == 0.0
    # 1-D inputs and an empty prompt give the same layout
    with torch.no_grad():
        no_prompt = lm.build_lm_input(vectors["llm.text"][0], torch.zeros(0, dtype=torch.long))
    assert no_prompt.shape == (25, 64)
    assert _maxerr(no_prompt, prompt[:25]) == 0.0


def test_build_lm_input_rejects_bad_ids(lm):
    with pytest.raises(InputError, match="text id out of range"):
        lm.build_lm_input(torch.tensor([1, 512]), None)
    with pytest.raises(InputError, match="prompt speech token out of range"):
        lm.build_lm_input(torch.tensor([1, 2]), torch.tensor([6561]))
    with pytest.raises(InputError, match="empty"):
        lm.build_lm_input(torch.zeros(1, 0, dtype=torch.long), None)


def test_build_lm_input_checks_ids_on_the_host_before_uploading(lm, monkeypatch):
    """The scheduler's frontend hands host ids: they are checked where they are, then uploaded (pinned, without
    blocking), and [sos, task_id] is made once per device. On a GPU a check of uploaded ids, or a tensor built from a
    list on the device, would wait for every kernel queued on the stream (other requests' DiT steps)."""
    import cosytrt.runtime.models.llm as llm_mod

    uploaded = []
    real = llm_mod.upload
    monkeypatch.setattr(llm_mod, "upload", lambda t, dev: (uploaded.append(t.device.type), real(t, dev))[1])
    with pytest.raises(InputError, match="text id out of range"):
        lm.build_lm_input(torch.tensor([1, 512]), torch.tensor([3]))
    with pytest.raises(InputError, match="prompt speech token out of range"):
        lm.build_lm_input(torch.tensor([1, 2]), torch.tensor([-1]))
    assert uploaded == []  # refused before anything moved
    with torch.inference_mode():
        a = lm.build_lm_input(torch.tensor([1, 2, 3]), torch.tensor([4, 5]))
    b = lm.build_lm_input(torch.tensor([1, 2, 3]), torch.tensor([4, 5]))
    assert uploaded == ["cpu"] * 4 and torch.equal(a, b)
    assert lm._special_ids(lm.device) is lm._special_ids(lm.device) and not lm._special_ids(lm.device).is_inference()


# ---------------------------------------------------------------- checkpoint layout

def test_full_size_meta_keys_equal_released_layout():
    with open(os.path.join(GOLDEN, "full_size_state_dict_keys.json")) as f:
        released = json.load(f)["llm"]
    with torch.device("meta"):
        m = CosyVoice3LM(full_config().llm)
    shapes = m.checkpoint_shapes()
    assert shapes == {k: tuple(v) for k, v in released.items()}
    assert list(shapes) == list(released)          # same order too
    assert "llm.model.lm_head.weight" not in m.state_dict()


def test_tied_lm_head_is_optional(state_dict):
    cfg = config_from_golden_json(os.path.join(GOLDEN, "config.json")).llm
    m = CosyVoice3LM(cfg)
    m.load_checkpoint({k: v for k, v in state_dict.items() if k != "llm.model.lm_head.weight"})
    assert torch.equal(m.llm_decoder.weight, state_dict["llm_decoder.weight"])


def test_load_from_path():
    cfg = config_from_golden_json(os.path.join(GOLDEN, "config.json")).llm
    m = CosyVoice3LM(cfg)
    m.load_checkpoint(os.path.join(GOLDEN, "llm.pt"))
    with pytest.raises(CheckpointError, match="not found"):
        m.load_checkpoint(os.path.join(GOLDEN, "nope.pt"))


@pytest.mark.parametrize("case", ["missing", "unexpected", "misshaped", "misshaped_lm_head"])
def test_bad_checkpoint_names_the_key(state_dict, case):
    cfg = config_from_golden_json(os.path.join(GOLDEN, "config.json")).llm
    m = CosyVoice3LM(cfg)
    sd = dict(state_dict)
    if case == "missing":
        key = "llm.model.model.layers.1.self_attn.k_proj.bias"
        del sd[key]
    elif case == "unexpected":
        key = "llm.model.model.layers.2.mlp.up_proj.weight"
        sd[key] = torch.zeros(128, 64)
    elif case == "misshaped":
        key = "llm_decoder.weight"
        sd[key] = torch.zeros(6760, 64)
    else:
        key = "llm.model.lm_head.weight"
        sd[key] = torch.zeros(511, 64)
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        m.load_checkpoint(sd)


# ---------------------------------------------------------------- KV cache

def test_prefill_then_decode_matches_full_forward(lm, vectors):
    lm_input = vectors["llm.lm_input"]           # [1, 54, 64]; prompt is the first 42 positions
    target = vectors["llm.target_speech"][0]     # 12 speech ids
    n_prompt = 42
    lm.setup_cache(1, 64)
    k_ptr = lm.backbone.layers[0].self_attn.kv_cache.k.data_ptr()
    slots = torch.tensor([0])
    with torch.no_grad():
        ref = lm(lm_input)[0]                    # [54, V]
        step_logits = [lm.prefill(lm_input[:, :n_prompt], torch.tensor([n_prompt]), slots)[0]]
        for i in range(len(target) - 1):
            step_logits.append(lm.decode(target[i:i + 1], slots, torch.tensor([n_prompt + i]))[0])
    got = torch.stack(step_logits)
    assert _maxerr(got, ref[n_prompt - 1:n_prompt - 1 + len(target)]) <= TOL
    assert _maxerr(got, vectors["llm.logits"][0, n_prompt - 1:n_prompt - 1 + len(target)]) <= TOL
    assert lm.backbone.layers[0].self_attn.kv_cache.k.data_ptr() == k_ptr   # no reallocation


def test_decode_accepts_embeddings_and_kv_len(lm, vectors):
    lm_input = vectors["llm.lm_input"]
    lm.setup_cache(2, 128)
    slots = torch.tensor([1])
    tok = vectors["llm.target_speech"][0, :1]
    with torch.no_grad():
        lm.prefill(lm_input[:, :42], torch.tensor([42]), slots)
        a = lm.decode(tok, slots, torch.tensor([42]))
        b = lm.decode(lm.embed_speech(tok), slots, torch.tensor([42]), kv_len=48)   # rewrites position 42
        ref = lm(lm_input[:, :43])[0, -1]
    assert _maxerr(a[0], ref) <= TOL and _maxerr(b[0], ref) <= TOL


def test_batched_rows_of_different_lengths_equal_each_row_alone(lm, vectors):
    torch.manual_seed(0)
    base = vectors["llm.lm_input"][0]
    lengths = [30, 42, 17]
    prompts = [base[:30], base[:42], torch.randn(17, 64) * 0.5]
    steps = 4
    feed = torch.randint(0, 6561, (3, steps))
    t = max(lengths)
    embeds = torch.zeros(3, t, 64)
    for i, p in enumerate(prompts):
        embeds[i, :len(p)] = p
        embeds[i, len(p):] = 7.0                 # padding garbage must not leak
    lm.setup_cache(4, 64)
    slots = torch.tensor([3, 0, 2])
    lens = torch.tensor(lengths)
    with torch.no_grad():
        batched = [lm.prefill(embeds, lens, slots)]
        for s in range(steps - 1):
            batched.append(lm.decode(feed[:, s], slots, lens + s, kv_len=48))
        batched = torch.stack(batched, dim=1)    # [3, steps, V]
        for i, p in enumerate(prompts):
            seq = torch.cat([p, lm.embed_speech(feed[i, :steps - 1])])[None]
            alone = lm(seq)[0, len(p) - 1:]
            assert alone.shape[0] == steps
            assert _maxerr(batched[i], alone) <= TOL


def test_slots_none_means_rows_in_order(lm, vectors):
    base = vectors["llm.lm_input"][0]
    embeds = torch.stack([base[:20], base[10:30]])
    lens = torch.tensor([20, 15])
    feed = torch.tensor([[5, 6], [7, 8]])
    lm.setup_cache(2, 32)
    with torch.no_grad():
        a = [lm.prefill(embeds, lens, torch.tensor([0, 1]))]
        a += [lm.decode(feed[:, s], torch.tensor([0, 1]), lens + s, kv_len=24) for s in range(2)]
        b = [lm.prefill(embeds, lens, None)]
        b += [lm.decode(feed[:, s], None, lens + s, kv_len=24) for s in range(2)]
    for x, y in zip(a, b):
        assert _maxerr(x, y) <= 1e-6


def test_prefill_return_hidden_and_cache_errors(lm, vectors):
    cfg = lm.config
    fresh = CosyVoice3LM(cfg)
    with pytest.raises(InputError, match="setup_cache"):
        fresh.prefill(torch.zeros(1, 4, 64), torch.tensor([4]), torch.tensor([0]))
    with pytest.raises(InputError, match="slots"):
        fresh.setup_cache(0, 16)
    lm.setup_cache(1, 16)
    with pytest.raises(InputError, match="max_len 16"):
        lm.prefill(vectors["llm.lm_input"][:, :20], torch.tensor([20]), torch.tensor([0]))
    with torch.no_grad():
        logits, hidden = lm.prefill(vectors["llm.lm_input"][:, :10], torch.tensor([10]), torch.tensor([0]),
                                    return_hidden=True)
    assert hidden.shape == (1, 10, 64)
    assert _maxerr(hidden, vectors["llm.hidden"][:, :10]) <= TOL
    assert _maxerr(logits[0], vectors["llm.logits"][0, 9]) <= TOL


def test_float64_cast_runs(state_dict, vectors):
    cfg = config_from_golden_json(os.path.join(GOLDEN, "config.json")).llm
    m = CosyVoice3LM(cfg)
    m.load_checkpoint(state_dict)
    m = m.to(torch.float64).eval()
    with torch.no_grad():
        h = m.forward_hidden(vectors["llm.lm_input"].double())
    assert h.dtype == torch.float64
    assert _maxerr(h.float(), vectors["llm.hidden"]) <= TOL


def test_prefill_attention_never_uses_cudnn(lm, vectors, monkeypatch):
    """The prefill's shapes vary per admission; cuDNN attention would build a plan per new shape (a stall of the AR
    worker), so its SDPA runs with the cuDNN backend disabled. The decode step keeps the default backends."""
    from cosytrt.runtime.models import llm as llm_module

    seen = []
    sdpa = llm_module.F.scaled_dot_product_attention

    def recording(*args, **kw):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kw)

    monkeypatch.setattr(llm_module.F, "scaled_dot_product_attention", recording)
    lm.setup_cache(2, 64)
    lm_input = vectors["llm.lm_input"]
    with torch.no_grad():
        lm.prefill(lm_input[:, :40].expand(2, -1, -1), torch.tensor([40, 31]), torch.tensor([0, 1]))
        n_prefill = len(seen)
        lm.decode(torch.tensor([3, 4, 5]), torch.tensor([0, 1, 1]), torch.tensor([40, 31, 32]))
    assert n_prefill == lm.config.qwen.num_hidden_layers and not any(seen[:n_prefill])
    assert all(seen[n_prefill:]) and len(seen) == 2 * n_prefill  # decode (3 rows: SDPA) with the default backends


def _decode_graph_ops(m, rows: int, **kw) -> set:
    """The ops of `m.decode` on `rows` rows as dynamo traces it (a recording backend that runs the graph eagerly:
    no Inductor compile)."""
    ops = set()

    def backend(gm, example_inputs):
        ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step(tokens, slots, positions):
        return m.decode(tokens, slots, positions, kv_len=24, **kw)

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(step, backend=backend, fullgraph=True)(
                torch.arange(rows), torch.arange(rows), torch.full((rows,), 5))
    finally:
        torch._dynamo.reset()
    return ops


def _has_sdpa(ops: set) -> bool:
    return any("scaled_dot_product_attention" in o for o in ops)


def test_reduce_attention_rows_is_a_per_lm_setting_and_a_per_call_argument(state_dict):
    """The compiled decode's attention form for small batches (multiply-and-sum up to `reduce_attention_max_rows`
    rows, SDPA above) is set per LM instance or per `decode` call, never by assigning a module constant (the micro
    bench used to set `llm.REDUCE_ATTENTION_MAX_ROWS = 0` for its SDPA column)."""
    from cosytrt.runtime.models import llm as llm_module

    cfg = config_from_golden_json(os.path.join(GOLDEN, "config.json")).llm
    m = CosyVoice3LM(cfg).eval()
    m.load_checkpoint(state_dict)
    m.setup_cache(4, 32)
    assert m.reduce_attention_max_rows == llm_module.REDUCE_ATTENTION_MAX_ROWS == 2
    assert not _has_sdpa(_decode_graph_ops(m, 2))                                # default: reduce form at 2 rows
    assert _has_sdpa(_decode_graph_ops(m, 3))                                    # SDPA above
    assert _has_sdpa(_decode_graph_ops(m, 2, reduce_attention_max_rows=0))       # per call: SDPA at every batch
    m.reduce_attention_max_rows = 0                                              # per instance
    assert _has_sdpa(_decode_graph_ops(m, 1))
    assert llm_module.REDUCE_ATTENTION_MAX_ROWS == 2                             # the default is untouched
    other = CosyVoice3LM(cfg).eval()
    assert other.reduce_attention_max_rows == 2


def test_no_module_assigns_the_reduce_attention_default():
    """Static check over the package: `REDUCE_ATTENTION_MAX_ROWS` is defined once and never assigned elsewhere."""
    import ast

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    offenders = []
    for folder in ("runtime", "tools", "build", "engines", "benchmarks"):
        for dirpath, _dirs, files in os.walk(os.path.join(root, folder)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(dirpath, f)
                with open(path, encoding="utf-8") as fh:
                    tree = ast.parse(fh.read(), path)
                for node in ast.walk(tree):
                    targets = (node.targets if isinstance(node, ast.Assign)
                               else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
                    for t in targets:
                        if isinstance(t, ast.Attribute) and t.attr == "REDUCE_ATTENTION_MAX_ROWS":
                            offenders.append(f"{path}:{node.lineno}")
                        if isinstance(t, ast.Name) and t.id == "REDUCE_ATTENTION_MAX_ROWS" and \
                                not path.endswith(os.path.join("runtime", "models", "llm.py")):
                            offenders.append(f"{path}:{node.lineno}")
    assert not offenders, offenders
