"""Step-level flow solving: rows joining at different Euler steps give each row its own solve's mel."""
import os

import pytest
import torch
from safetensors.torch import load_file

from cosytrt.engines.errors import InputError
from cosytrt.runtime.models.checkpoint import read_state_dict
from cosytrt.runtime.models.config import config_from_golden_json
from cosytrt.runtime.models.flow import Flow, FlowInput
from cosytrt.runtime.stages.flow_steps import FlowStepper

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden")
BATCH_TOL = 1e-4  # the flow's batching bound (tests/test_flow.py): rows batched together vs alone


@pytest.fixture(scope="module")
def flow():
    cfg = config_from_golden_json(os.path.join(GOLDEN, "config.json")).flow
    return Flow(cfg).eval().load_checkpoint(read_state_dict(os.path.join(GOLDEN, "flow.pt")))


@pytest.fixture(scope="module")
def rows():
    v = load_file(os.path.join(GOLDEN, "vectors.safetensors"))
    ptok, pfeat, emb, tok = (v[k][0] for k in ("flow.prompt_token", "flow.prompt_feat", "flow.embedding",
                                                "flow.token"))
    g = torch.Generator().manual_seed(7)
    tok2, emb2 = torch.randint(0, 6561, (43,), generator=g), torch.randn(192, generator=g)
    return [FlowInput(tok, ptok, pfeat, emb, finalize=False), FlowInput(tok2, ptok[:7], pfeat[:14], emb2, finalize=False),
            FlowInput(tok[:11], ptok[5:], pfeat[10:], emb2, finalize=False)]


@pytest.mark.parametrize("streaming", [True, False])
def test_rows_joining_at_other_steps_equal_their_own_solve(flow, rows, streaming):
    stepper = FlowStepper(flow)
    a = stepper.start(rows[0], streaming)
    for _ in range(3):
        stepper.step([a])
    b = stepper.start(rows[1], streaming)
    for _ in range(4):
        stepper.step([a, b])                     # a at steps 3..6, b at 0..3 in one call
    c = stepper.start(rows[2], streaming)
    stepper.step([c, b, a])
    while not a.done:
        stepper.step([a, c])
    while not (b.done and c.done):
        stepper.step([s for s in (b, c) if not s.done])
    for s, r in zip((a, b, c), rows):
        alone = flow.inference_batch([r], streaming=streaming)[0]
        assert s.mel().shape == alone.shape
        assert (s.mel() - alone).abs().max().item() <= BATCH_TOL


def test_a_row_stepped_alone_is_bit_identical_to_the_solve(flow, rows):
    s = FlowStepper(flow).start(rows[0], True)
    while not s.done:
        FlowStepper(flow).step([s])
    assert torch.equal(s.mel(), flow.inference_batch([rows[0]], streaming=True)[0])


def test_misuse_is_refused(flow, rows):
    stepper = FlowStepper(flow)
    a, b = stepper.start(rows[0], True), stepper.start(rows[1], False)
    with pytest.raises(InputError, match="one attention mode"):
        stepper.step([a, b])
    with pytest.raises(InputError, match="no mel yet"):
        a.mel()
    while not a.done:
        stepper.step([a])
    with pytest.raises(InputError, match="stepped again"):
        stepper.step([a])
