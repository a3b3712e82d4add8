"""A CPU stand-in for `GraphCache` (the AR graph ladders' CUDA-graph cache), shared by the AR graph tests, and the
prefilled rows their CUDA tests decode from."""


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


def prefilled_rows(runner, config, n: int = 5):
    """n requests prefilled into `runner` (a TorchARRunner; random prompts of 6.. positions on its device) with
    their token policies (seed i, row 3 greedy, 30..200 tokens): (policies, slots, positions) — the CUDA tests of the
    AR graphs decode from here."""
    import torch

    from cosytrt.runtime.models.sampling import SamplingParams, TokenPolicy
    from cosytrt.runtime.stages.ar_runner import PrefillRow

    g = torch.Generator().manual_seed(0)
    policies, slots, pos = [], [], []
    for i in range(n):
        slot = runner.allocate()
        length = 6 + i
        embeds = torch.randn(length, config.qwen.hidden_size, generator=g).to(runner.device)
        with torch.inference_mode():
            runner.prefill([PrefillRow(slot, embeds)])
        pol = TokenPolicy(4, SamplingParams(seed=i, greedy=i == 3, max_tokens=200, min_tokens=30),
                          speech_token_size=config.speech_token_size)
        pol.next_input = i
        policies.append(pol), slots.append(slot), pos.append(length)
    return policies, slots, pos
