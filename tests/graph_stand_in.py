"""A CPU stand-in for `GraphCache` (the AR graph ladders' CUDA-graph cache), shared by the AR graph tests."""


class DirectCall:
    """Stands in for GraphCache: `capture` records the key and the static input shapes, `run` checks the inputs have
    exactly the captured shapes and calls fn."""

    def __init__(self, fn, device, warmup: int = 2):
        self.fn, self.shapes = fn, {}

    def capture(self, key, example_inputs):
        self.shapes[key] = [tuple(x.shape) for x in example_inputs]

    def run(self, key, *inputs):
        assert [tuple(x.shape) for x in inputs] == self.shapes[key]  # exactly the captured shapes
        return self.fn(*inputs)
