"""Builds LMCache's CUDA extension (``cuda_ops``) from its source distribution against the torch at hand.

    python scripts/build_lmcache_ops.py lmcache-0.5.6.tar.gz OUTDIR

LMCache's published wheels link against one torch release; where the
machine's torch is another, their extension fails to load (an undefined
c10 symbol), so a side-by-side run (``kvlayout.bench.side_by_side``) needs
the extension built here. This compiles the sources LMCache's own CUDA
build profile names (``setup_extensions/build_profiles/cuda.py`` of the
sdist) with ``torch.utils.cpp_extension`` for this device's architecture
only, and prints the path of the built module (``OUTDIR/cuda_ops*.so``),
which ``side_by_side --lmcache`` takes. Nothing of LMCache is installed or
imported besides that one module.
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
    missing = [s for s in SOURCES if not os.path.exists(os.path.join(root, s))]
    if missing:
        print(f"build_lmcache_ops: {sdist} lacks {missing} (another LMCache layout)", file=sys.stderr)
        return 1
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"
    os.makedirs(out, exist_ok=True)
    cpp_extension.load(name="cuda_ops", sources=[os.path.join(root, s) for s in SOURCES],
                       extra_include_paths=[os.path.join(root, "csrc")], extra_cflags=["-O3", abi],
                       extra_cuda_cflags=["-O3", abi], build_directory=out, verbose=False)
    built = [f for f in os.listdir(out) if f.startswith("cuda_ops") and f.endswith(".so")]
    print(os.path.join(out, built[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
