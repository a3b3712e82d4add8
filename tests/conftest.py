import os

import pytest

# The Triton kernels' CPU tests run through Triton's interpreter, which reads TRITON_INTERPRET when triton.language is
# first imported: its standard functions (tl.sum, tl.max) become interpreter functions only then. Set here, before
# any test module is collected (one that compiles with Inductor imports triton.language on collection, and the
# interpreter tests collected after it then failed with "Cannot call @triton.jit'd outside of the scope of a kernel").
# The interpreter test modules set the same default; on a machine with a GPU the kernels run compiled.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN_DIR = os.path.join(HERE, "data", "golden")


@pytest.fixture(scope="session", autouse=True)
def _cosytrt_cache(tmp_path_factory):
    """One user-cache folder for the whole test session (the tiny model is created there once)."""
    if "COSYTRT_CACHE" not in os.environ:
        os.environ["COSYTRT_CACHE"] = str(tmp_path_factory.mktemp("cosytrt_cache"))
    yield


@pytest.fixture(scope="session")
def golden_dir():
    return GOLDEN_DIR


@pytest.fixture(scope="module")
def one_torch_thread():
    """The tiny model runs as fast on one thread, and a busy 2-core machine slows multi-threaded torch next to ONNX
    Runtime's worker threads by up to 5x."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_tts():
    """A TTS on the embedded tiny model, one per test module (its scheduler starts on first use)."""
    from cosytrt.runtime.tts import TTS

    t = TTS.load("tiny")
    yield t
    t.close()


@pytest.fixture(scope="module")
def golden_vectors():
    from safetensors.torch import load_file

    return load_file(os.path.join(GOLDEN_DIR, "vectors.safetensors"))


@pytest.fixture(scope="module")
def golden_lm():
    """The tiny LM with the golden weights."""
    from cosytrt.runtime.models.config import config_from_golden_json
    from cosytrt.runtime.models.llm import CosyVoice3LM

    m = CosyVoice3LM(config_from_golden_json(os.path.join(GOLDEN_DIR, "config.json")).llm).eval()
    m.load_checkpoint(os.path.join(GOLDEN_DIR, "llm.pt"))
    return m
