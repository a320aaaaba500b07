"""Builds LMCache's CUDA extension (``cuda_ops``) from its source distribution against the torch at hand.

    python scripts/build_lmcache_ops.py lmcache-0.5.6.tar.gz OUTDIR

LMCache's published wheels link against one torch release; where the
machine's torch is another, their extension fails to load (an undefined
c10 symbol), so a side-by-side run (``kvlayout.bench.side_by_side``) needs
the extension built here. This compiles the sources LMCache's own CUDA
build profile names (``setup_extensions/build_profiles/cuda.py`` of the
sdist) with ``torch.utils.cpp_extension`` for this device's architecture
only, and prints the path of the built module (``OUTDIR/cuda_ops*.so``),
which ``side_by_side --lmcache`` takes.

``cuda_ops`` imports ``lmcache.lmcache_native`` as it loads (the enums and
descriptors the two modules share), so that module is built too, from the
sources of LMCache's common C++ build (``setup_extensions/common_cpp.py``),
into ``OUTDIR/lmcache/`` beside an empty ``__init__.py``: a package of that
one module, which ``side_by_side`` puts on ``sys.path`` before it loads
``cuda_ops``. Nothing else of LMCache is installed or imported.
"""

from __future__ import annotations

import os
import sys
import tarfile
import tempfile

# the extension's sources, as LMCache 0.5.x's CUDA build profile lists them (relative to the sdist's root)
SOURCES = ["csrc/cuda/pybind.cpp", "csrc/cuda/mem_kernels.cu", "csrc/cuda/mp_mem_kernels.cu",
           "csrc/cuda/phase_timing_recorder.cu", "csrc/cuda/blend_kernels.cu", "csrc/cuda/cal_cdf.cu",
           "csrc/cuda/ac_enc.cu", "csrc/cuda/ac_dec.cu", "csrc/cuda/pos_kernels.cu", "csrc/cuda/mem_alloc.cpp",
           "csrc/cuda/utils.cpp", "csrc/cuda/event_recorder.cpp", "csrc/cuda/completion_recorder.cpp"]
# the module cuda_ops imports as it loads, as LMCache 0.5.x's common C++ build lists its sources (plain C++)
NATIVE_SOURCES = ["csrc/lmcache_native/bitmap.cpp", "csrc/lmcache_native/fold.cpp",
                  "csrc/lmcache_native/periodic_event_notifier.cpp", "csrc/lmcache_native/pybind.cpp",
                  "csrc/lmcache_native/ttl_lock.cpp", "csrc/lmcache_native/utils.cpp"]
NATIVE_PACKAGE = "lmcache"   # cuda_ops imports lmcache.lmcache_native


def build_native(root: str, out: str, abi: str) -> None:
    """``lmcache.lmcache_native`` built into ``out/lmcache/`` (with an empty ``__init__.py``), not imported: the
    import of ``cuda_ops`` is its first, under the name ``cuda_ops`` asks for (pybind11 registers a module's
    types once per process); with ``out`` on ``sys.path`` that import finds it."""
    from torch.utils import cpp_extension

    package = os.path.join(out, NATIVE_PACKAGE)
    os.makedirs(package, exist_ok=True)
    open(os.path.join(package, "__init__.py"), "w").close()
    cpp_extension.load(name="lmcache_native", sources=[os.path.join(root, s) for s in NATIVE_SOURCES],
                       extra_include_paths=[os.path.join(root, "csrc", "lmcache_native"), os.path.join(root, "csrc")],
                       extra_cflags=["-O3", abi], build_directory=package, is_python_module=False, verbose=False)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    sdist, out = argv
    import torch
    from torch.utils import cpp_extension

    major, minor = torch.cuda.get_device_capability()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    source_dir = tempfile.mkdtemp(prefix="lmcache_src_")
    with tarfile.open(sdist) as tar:
        tar.extractall(source_dir, filter="data")
    (root,) = [os.path.join(source_dir, d) for d in os.listdir(source_dir)]
    missing = [s for s in SOURCES + NATIVE_SOURCES if not os.path.exists(os.path.join(root, s))]
    if missing:
        print(f"build_lmcache_ops: {sdist} lacks {missing} (another LMCache layout)", file=sys.stderr)
        return 1
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"
    os.makedirs(out, exist_ok=True)
    build_native(root, out, abi)
    sys.path.insert(0, out)   # (loading cuda_ops below imports lmcache.lmcache_native)
    cpp_extension.load(name="cuda_ops", sources=[os.path.join(root, s) for s in SOURCES],
                       extra_include_paths=[os.path.join(root, "csrc")], extra_cflags=["-O3", abi],
                       extra_cuda_cflags=["-O3", abi], build_directory=out, verbose=False)
    built = [f for f in os.listdir(out) if f.startswith("cuda_ops") and f.endswith(".so")]
    print(os.path.join(out, built[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
