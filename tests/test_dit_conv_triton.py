"""The DiT's grouped convolution as one Triton kernel (runtime/models/dit_conv_triton.py, `COSYTRT_DIT_CONV=triton`),
run through Triton's interpreter on CPU: F.conv1d's values for contiguous inputs and for the [B, C, T] views of
[B, T, C] tensors the DiT's cached forward passes, with and without bias, frames not a multiple of the tile, fp32 and
fp16; the tap-major weight copy is made once per weight; shapes it does not take are refused (the dit_conv wrapper
falls back to F.conv1d)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is first defined (on first use)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cosytrt.runtime.models import dit_conv, dit_conv_triton as tk  # noqa: E402

pytestmark = pytest.mark.skipif(not tk.available(), reason="Triton is not installed (the CPU torch wheel does not "
                                "bring it): the kernel runs on a GPU machine or through Triton's interpreter")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 2e-2)])
@pytest.mark.parametrize("layout", ["contiguous", "time_major"])
def test_kernel_equals_conv1d(dtype, tol, layout):
    g = torch.Generator().manual_seed(0)
    groups, cg, k = 4, 16, 31
    c = groups * cg
    w = torch.randn(c, cg, k, generator=g) * 0.05
    bias = torch.randn(c, generator=g) * 0.1
    for rows, frames in ((1, k), (2, k + 70), (3, k + 129)):  # 1, 71 and 130 output frames (tiles of 64)
        if layout == "contiguous":
            x = torch.randn(rows, c, frames, generator=g)
        else:  # the DiT's form: [B, T, C] storage seen as [B, C, T]
            x = torch.randn(rows, frames, c, generator=g).transpose(1, 2)
        for b in (bias, None):
            ref = F.conv1d(x.double(), w.double(), None if b is None else b.double(), groups=groups)
            for time_major in (True, False):  # the output time-major (the DiT's layout, default) or contiguous
                got = tk.grouped_conv1d(x.to(dtype), w.to(dtype), None if b is None else b.to(dtype), groups,
                                        time_major=time_major)
                assert got.shape == ref.shape and got.dtype == dtype
                assert got.transpose(1, 2).is_contiguous() if time_major else got.is_contiguous()
                assert (got.double() - ref).abs().max().item() <= tol


def test_tap_major_copy_is_made_once_per_weight():
    tk._TAP_MAJOR.clear()
    w = torch.randn(32, 16, 5)
    a = tk.tap_major(w, 2)
    assert tk.tap_major(w, 2) is a and len(tk._TAP_MAJOR) == 1
    assert torch.equal(a[1, 3], w[16:32, :, 3].t())  # group 1, tap 3: [in, out]
    with torch.no_grad():
        w.add_(1.0)  # changed in place: a new copy
    assert not torch.equal(tk.tap_major(w, 2), a)


def test_unsupported_shapes_are_refused_and_the_wrapper_falls_back():
    x, w = torch.randn(1, 24, 40), torch.randn(24, 8, 5)  # 8 channels per group: below tl.dot's 16
    assert not tk.supports(x, w, 3)
    with pytest.raises(ValueError, match="channels per group"):
        tk.grouped_conv1d(x, w, None, 3)
    torch.testing.assert_close(dit_conv.triton_conv(x, w, None, 3), F.conv1d(x, w, groups=3), rtol=0, atol=0)


def test_the_larger_tile_gives_the_same_values():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(32, 16, 7, generator=g) * 0.1, torch.randn(2, 200, 32, generator=g).transpose(1, 2)
    a = tk.grouped_conv1d(x, w, None, 2)
    b = tk.grouped_conv1d(x, w, None, 2, block_t=128, num_warps=8)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    torch.testing.assert_close(a, F.conv1d(x, w, groups=2), rtol=1e-4, atol=1e-4)

