"""`engines/cuda_graphs.capture_group_on` (the scheduler's SM partition, dit_green_reserve_sms): a group's graph
caches are captured again on the stream asked for — each key in its first capture's order, on its own static input
buffers, with the key's own function — only where they were captured elsewhere; other groups and devices are left;
an empty cache's first captures go there. The capture itself is stubbed (CUDA graphs need a GPU: the GPU run is
benchmarks/green_tts_check.py)."""
import torch

from cosytrt.engines import cuda_graphs
from cosytrt.engines.cuda_graphs import GraphCache, capture_group_on


def test_capture_group_on_moves_a_groups_graphs_and_back(monkeypatch):
    captured = []

    def fake_capture(self, key, example_inputs, static=False, collect=True, fn=None):
        fn = self._fns.get(key, self.fn)
        captured.append((self.group, key, static, example_inputs, fn, self._stream))
        self.graphs[key] = ("graph", tuple(example_inputs), "out")

    monkeypatch.setattr(GraphCache, "capture", fake_capture)
    own = lambda *a: None  # noqa: E731
    dit = GraphCache(lambda *a: None, "cuda:0", group="dit")
    buf_a, buf_b = (torch.zeros(2),), (torch.zeros(1),)
    dit.graphs = {"big": ("g", buf_a, "o"), "small": ("g", buf_b, "o")}  # captured largest first
    dit._fns["small"] = own
    hift = GraphCache(lambda *a: None, "cuda:0", group="hift")
    hift.graphs = {"w": ("g", buf_a, "o")}
    other_device = GraphCache(lambda *a: None, "cuda:1", group="dit")
    other_device.graphs = {"k": ("g", buf_a, "o")}
    empty = GraphCache(lambda *a: None, "cuda:0", group="dit")
    green = object()  # stands in for a green context's stream

    assert capture_group_on("dit", "cuda:0", green) == 1
    assert [(g, k, static, s) for g, k, static, _, _, s in captured] == [("dit", "big", True, green),
                                                                           ("dit", "small", True, green)]
    assert captured[0][3] is buf_a and captured[1][3] is buf_b  # the same static input buffers
    assert captured[1][4] is own and captured[0][4] is dit.fn     # each key's own function
    assert empty._stream is green and empty._asked is green      # its first captures go there
    assert hift._asked is None and other_device._asked is None   # other groups / devices untouched
    captured.clear()
    assert capture_group_on("dit", "cuda:0", green) == 0 and captured == []  # already there: nothing again
    assert capture_group_on("dit", "cuda:0", None) == 1                       # back to a stream of its own
    assert [k for _, k, *_ in captured] == ["big", "small"] and dit._asked is None
    assert dit in set(cuda_graphs._CACHES) and GraphCache(None, "cpu") not in set(cuda_graphs._CACHES)
