"""Packaging: the torch range admits the GPU machine's and CI's torch, CI pins torch through .ci/constraints.txt,
extras keep the base install lean, LICENSE ships, optional imports name their extra. No network, no install."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _req(deps: list[str], name: str):
    from packaging.requirements import Requirement

    found = [Requirement(d) for d in deps if Requirement(d).name.lower() == name]
    assert len(found) == 1, (name, deps)
    return found[0]


def test_torch_range_admits_the_h200_and_ci_torch():
    torch_req = _req(_pyproject()["project"]["dependencies"], "torch")
    spec = torch_req.specifier
    assert not any(s.operator == "==" for s in spec), "an exact torch pin replaces a GPU machine's CUDA torch"
    for v in ("2.7.0", "2.9.1", "2.11.0", "2.13.0"):  # floor, TensorRT-LLM 1.2's, the H200's, CI's
        assert spec.contains(v, prereleases=True), (v, str(spec))
    for v in ("2.6.0", "2.14.0"):
        assert not spec.contains(v, prereleases=True), (v, str(spec))


def test_installed_torch_is_inside_the_range():
    import torch

    spec = _req(_pyproject()["project"]["dependencies"], "torch").specifier
    assert spec.contains(torch.__version__.split("+")[0], prereleases=True)


def test_ci_constraints_pin_torch_inside_the_range():
    from packaging.requirements import Requirement

    with open(os.path.join(ROOT, ".ci", "constraints.txt")) as f:
        lines = [ln.split("#")[0].strip() for ln in f]
    pins = [Requirement(ln) for ln in lines if ln and not ln.startswith("-")]
    (torch_pin,) = [r for r in pins if r.name == "torch"]
    (pin,) = list(torch_pin.specifier)
    assert pin.operator == "=="
    assert _req(_pyproject()["project"]["dependencies"], "torch").specifier.contains(pin.version)
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        run = f.read()
    assert run.count("-c .ci/constraints.txt") >= 2 and "--dry-run" in run  # resolve, then install, both pinned


def test_base_install_is_lean_and_extras_cover_the_commands():
    p = _pyproject()["project"]
    base = {re.split(r"[<>=!~\[ ;]", d)[0].lower() for d in p["dependencies"]}
    for heavy in ("matplotlib", "polygraphy", "onnxscript", "ray", "librosa", "tensorrt", "fastapi"):
        assert heavy not in base, heavy
    extras = p["optional-dependencies"]
    assert extras["plot"] == ["matplotlib"] and extras["parity"] == ["polygraphy"] and extras["onnx"] == ["onnxscript"]
    test = " ".join(extras["test"])
    assert "ray" not in test and "librosa" not in test  # their tests skip with the reason
    assert {"onnxscript", "polygraphy", "matplotlib", "pytest"} <= set(extras["test"])


def test_license_file_is_the_apache_text():
    with open(os.path.join(ROOT, "LICENSE")) as f:
        text = f.read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert "Apache-2.0" in str(_pyproject()["project"]["license"])


def test_packages_in_pyproject_exist():
    tool = _pyproject()["tool"]["setuptools"]
    for pkg in tool["packages"]:
        folder = tool["package-dir"].get(pkg) or os.path.join(
            tool["package-dir"][pkg.rsplit(".", 1)[0]], pkg.rsplit(".", 1)[1])
        assert os.path.isfile(os.path.join(ROOT, folder, "__init__.py")), pkg


def test_missing_extra_names_the_extra(monkeypatch):
    from cosytrt.extras import MissingExtraError, require
    from cosytrt.engines.errors import CosytrtError

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    with pytest.raises(MissingExtraError, match=r"pip install -e \"\.\[plot\]\"") as e:
        require("matplotlib", "plot", "the coverage heatmap")
    assert isinstance(e.value, CosytrtError) and isinstance(e.value, ImportError)
    assert "the coverage heatmap needs the Python package 'matplotlib'" in str(e.value)


def test_cli_starts_without_the_optional_packages(tmp_path):
    """`trtbuild --help` and `--version` import none of matplotlib / polygraphy / onnxscript / ray / librosa."""
    code = ("import sys; from cosytrt.tools.trtbuild import main\n"
            "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
            "bad = [m for m in ('matplotlib', 'polygraphy', 'onnxscript', 'ray', 'librosa') if m in sys.modules]\n"
            "print('LOADED', bad)")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=120)
    assert "LOADED []" in out.stdout, out.stdout + out.stderr
    assert re.search(r"cosytrt \d+\.\d+\.\d+ \(torch ", out.stdout), out.stdout
