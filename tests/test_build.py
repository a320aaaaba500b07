"""The build wires every backend: CPU always, CUDA and SYCL sources when their toolchains exist.

No machine here has an XPU or icpx, so the SYCL sources are checked for
presence, for sharing the address/kernel headers and the launchers with CUDA,
for registering the XPU dispatch key and bound-launch factory, and for being
handed to ``SyclExtension`` by setup.py when torch reports XPU and icpx is on
the PATH.
"""

import pathlib
import re
import shutil

import pytest
import setuptools
import torch
from torch.utils import cpp_extension

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_HEADERS = ("kvlayout/copy_rows_kernel.h", "kvlayout/rope_kernel.h")


@pytest.mark.parametrize("backend,suffix,key", [("cuda", "cu", "CUDA"), ("sycl", "sycl", "XPU")])
def test_device_sources_share_the_kernel_headers_and_register_their_key(backend, suffix, key):
    # an op's sources: its files of the backend (copy_rows.cu with copy_rows_cuda.cuh and its kernels' files)
    files = sorted((ROOT / "torch_ext" / backend).glob(f"*.{suffix}*"))
    sources = {op: "".join(p.read_text() for p in files if p.stem.startswith(op)) for op in ("copy_rows", "rope")}
    assert all(sources.values())
    assert f"TORCH_LIBRARY_IMPL(kvlayout, {key}, m)" in sources["copy_rows"]
    assert f"TORCH_LIBRARY_IMPL(kvlayout, {key}, m)" in sources["rope"]
    assert SHARED_HEADERS[0] in sources["copy_rows"] and SHARED_HEADERS[1] in sources["rope"]
    # one launcher per op for every device backend, and prepared copy programs on each
    assert '#include "../copy_rows_launch.h"' in sources["copy_rows"]
    assert '#include "../rope_launch.h"' in sources["rope"]
    assert f"register_bound_launch_factory(c10::DeviceType::{key}, &make_rows_launch<" in sources["copy_rows"]
    # no backend knows layout names: the address math lives in the shared header
    for text in sources.values():
        assert "vllm" not in text and "hicache" not in text and "sglang" not in text


def test_every_cuda_vector_width_is_compiled_once_and_declared_where_launched():
    """copy_rows_launch.h launches widths 16/8/4/2/1; CUDA compiles each width's kernels in a file of its own
    (copy_rows_vecW.cu), which copy_rows.cu declares extern so that it compiles none of them itself."""
    cuda = ROOT / "torch_ext" / "cuda"
    launcher = (ROOT / "torch_ext" / "copy_rows_launch.h").read_text()
    widths = sorted(int(w) for w in re.findall(r"(?:case \d+|default): launch_variant<(\d+)>", launcher))
    assert widths == [1, 2, 4, 8, 16]
    registering = (cuda / "copy_rows.cu").read_text()
    for w in widths:
        assert f"KVLAYOUT_CUDA_ROWS_INSTANCES(extern, {w});" in registering
        compiled = [p.name for p in cuda.glob("*.cu") if f"KVLAYOUT_CUDA_ROWS_INSTANCES(, {w});" in p.read_text()]
        assert compiled == [f"copy_rows_vec{w}.cu"]


def _run_setup(monkeypatch, *, xpu: bool, icpx: bool, sanitize: str = ""):
    """Execute setup.py with setuptools.setup and the extension classes recorded instead of built (its module
    namespace under ``made["setup_py"]``)."""
    made = {}

    def record(kind):
        def make(name, sources, **kwargs):
            made.update(kind=kind, name=name, sources=[str(s) for s in sources], kwargs=kwargs)
            return kind
        return make

    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: made.setdefault("setup", kwargs))
    for kind in ("CppExtension", "CUDAExtension", "SyclExtension"):
        monkeypatch.setattr(cpp_extension, kind, record(kind), raising=False)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: xpu)
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda cmd: "/opt/icpx" if cmd == "icpx" and icpx else real_which(cmd))
    monkeypatch.setenv("KVLAYOUT_FORCE_CPU_ONLY", "1")
    monkeypatch.setenv("KVLAYOUT_SANITIZE", sanitize)
    monkeypatch.chdir(ROOT)
    code = compile((ROOT / "setup.py").read_text(), str(ROOT / "setup.py"), "exec")
    made["setup_py"] = {"__name__": "__main__", "__file__": str(ROOT / "setup.py")}
    exec(code, made["setup_py"])
    return made


def test_setup_builds_sycl_sources_when_torch_has_xpu_and_icpx(monkeypatch):
    made = _run_setup(monkeypatch, xpu=True, icpx=True)
    assert made["kind"] == "SyclExtension" and made["name"] == "kvlayout._C"
    assert {pathlib.Path(s).name for s in made["sources"]} >= {"copy_rows.sycl", "rope.sycl", "copy_rows.cpp"}


def test_setup_builds_the_cpu_extension_without_accelerator_toolchains(monkeypatch):
    made = _run_setup(monkeypatch, xpu=False, icpx=False)
    assert made["kind"] == "CppExtension"
    names = {pathlib.Path(s).name for s in made["sources"]}
    assert "copy_rows.cpp" in names and not any(n.endswith((".cu", ".sycl")) for n in names)


def test_a_sanitizer_build_instruments_compile_and_link_and_is_its_own_fingerprint(monkeypatch):
    """scripts/sanitize_cpu.sh builds with KVLAYOUT_SANITIZE: the flags reach the compiler and the linker, and
    the next plain build sees a different fingerprint (so it replaces the instrumented library)."""
    plain = _run_setup(monkeypatch, xpu=False, icpx=False)
    assert not any("sanitize" in f for f in plain["kwargs"]["extra_compile_args"]["cxx"])
    assert plain["kwargs"]["extra_link_args"] == []
    plain_fingerprint = plain["setup_py"]["native_fingerprint"]()
    made = _run_setup(monkeypatch, xpu=False, icpx=False, sanitize="address,undefined")
    cxx = made["kwargs"]["extra_compile_args"]["cxx"]
    assert "-fsanitize=address,undefined" in cxx and "-fno-sanitize-recover=all" in cxx and "-O3" not in cxx
    assert made["kwargs"]["extra_link_args"] == ["-fsanitize=address,undefined"]
    assert made["setup_py"]["native_fingerprint"]() != plain_fingerprint
