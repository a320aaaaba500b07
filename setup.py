"""Build of kvlayout's native extension, kvlayout._C.

CPU sources are always built. CUDA sources are added when torch was built
with CUDA and nvcc is found (CUDA_HOME), unless KVLAYOUT_FORCE_CPU_ONLY=1.
SYCL sources are added when torch has XPU and icpx is on PATH. CUDA targets
sm_90 + PTX by default; TORCH_CUDA_ARCH_LIST overrides it.

The extension must link the same shared libstdc++ as torch. A toolchain
that links libstdc++ statically into shared objects (CXX pointing at such a
g++) produces a _C.so that crashes on its first formatted error message;
build with the system compiler then (CXX=/usr/bin/g++ CC=/usr/bin/gcc).

An in-place or editable build is skipped when nothing native changed: the
fingerprint of the sources under torch_ext/, this file, the torch version and
the build choices (CUDA/SYCL, compilers, architectures) is stored next to the
built library (kvlayout/_C.build-stamp) and compared on the next build.
KVLAYOUT_REBUILD=1 rebuilds anyway.  A wheel (not in place) is always built.

KVLAYOUT_SANITIZE=address,undefined (any -fsanitize= list) builds the host
C++ with those sanitizers (and -O1 -g, frame pointers kept) for
scripts/sanitize_cpu.sh; the choice is part of the fingerprint, so the next
plain build replaces that library.
"""

import glob
import hashlib
import json
import os
import shutil
import sysconfig

import torch
from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
EXT = os.path.join("torch_ext")


def _sources(*patterns):
    out = []
    for pattern in patterns:
        out.extend(sorted(glob.glob(os.path.join(EXT, pattern))))
    return out


def _want_cuda():
    if os.environ.get("KVLAYOUT_FORCE_CPU_ONLY", "0") == "1":
        return False
    if not torch.version.cuda:
        return False
    return cpp_extension.CUDA_HOME is not None and (
        os.path.exists(os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")) or shutil.which("nvcc")
    )


def _want_sycl():
    has_xpu = bool(getattr(torch.version, "xpu", None))
    try:
        has_xpu = has_xpu or torch.xpu.is_available()
    except Exception:
        pass
    return has_xpu and shutil.which("icpx") is not None and hasattr(cpp_extension, "SyclExtension")


STAMP = os.path.join(ROOT, "kvlayout", "_C.build-stamp")
"""The fingerprint of the native sources and build choices that the in-place library was built from."""


def built_library() -> str:
    """Where an in-place or editable build puts the extension."""
    return os.path.join(ROOT, "kvlayout", "_C" + sysconfig.get_config_var("EXT_SUFFIX"))


def native_fingerprint() -> str:
    """sha256 of every file under torch_ext/ and setup.py (paths and contents), the torch version and the choices
    this build makes (CUDA/SYCL kernels, compilers, CUDA architectures)."""
    h = hashlib.sha256()
    files = sorted(f for f in glob.glob(os.path.join(ROOT, EXT, "**"), recursive=True) if os.path.isfile(f))
    for path in files + [os.path.join(ROOT, "setup.py")]:
        h.update(os.path.relpath(path, ROOT).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read() + b"\0")
    choices = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
               "suffix": sysconfig.get_config_var("EXT_SUFFIX"), "cuda": bool(_want_cuda()), "sycl": bool(_want_sycl()),
               **{k: os.environ.get(k, "") for k in ("TORCH_CUDA_ARCH_LIST", "CUDA_HOME", "CXX", "CC",
                                                      "KVLAYOUT_FORCE_CPU_ONLY", "KVLAYOUT_SANITIZE")}}
    h.update(json.dumps(choices, sort_keys=True).encode())
    return h.hexdigest()


def native_status() -> tuple[bool, str]:
    """(whether the in-place library is current, why) - what an in-place build decides."""
    if os.environ.get("KVLAYOUT_REBUILD", "0") == "1":
        return False, "KVLAYOUT_REBUILD=1"
    if not os.path.exists(built_library()):
        return False, f"no {os.path.relpath(built_library(), ROOT)} yet"
    try:
        with open(STAMP, encoding="utf-8") as f:
            stamp = f.read().strip()
    except OSError:
        return False, f"no {os.path.relpath(STAMP, ROOT)} (built by another route)"
    if stamp != native_fingerprint():
        return False, "torch_ext/, setup.py, torch or the build choices changed since the last build"
    return True, f"torch_ext/, setup.py and torch {torch.__version__} unchanged since the last build"


# nvcc's flags for the CUDA sources (scripts/cuda_compile_check.py reads them from here), and the architectures
# built where TORCH_CUDA_ARCH_LIST does not name others: Hopper code, and its PTX for later GPUs.
NVCC_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]
NVCC_DEFAULT_ARCHES = ["-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_90,code=compute_90"]


def _extension():
    include_dirs = [os.path.join(ROOT, EXT, "include"), os.path.join(ROOT, EXT)]
    sources = _sources("registration.cpp", "python_module.cpp", "program.cpp", "copy_plan.cpp", "slots.cpp",
                       "rope_plan.cpp", "device_args.cpp", "staged.cpp", "cpu/*.cpp")
    # -g0 after Python's own CFLAGS (which carry -g): no debug information, as torch's own libraries ship; on
    # 2 cores it cuts the build from 82 s to 48 s and shrinks the library from 22 MB to 1 MB
    cxx_flags = ["-O3", "-std=c++17", "-g0"]
    link_flags = []
    sanitize = os.environ.get("KVLAYOUT_SANITIZE", "")
    if sanitize:
        # the host code as the sanitizers see it: -O1 keeps the reports' stacks readable, and a report stops
        # the process (no recovery) so that a test cannot pass over one
        cxx_flags = ["-O1", "-g", "-std=c++17", f"-fsanitize={sanitize}", "-fno-omit-frame-pointer",
                     "-fno-sanitize-recover=all"]
        link_flags = [f"-fsanitize={sanitize}"]
    define_macros = []

    if _want_cuda():
        sources += _sources("cuda/*.cu")
        nvcc_flags = list(NVCC_FLAGS)
        if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            nvcc_flags += NVCC_DEFAULT_ARCHES
        define_macros.append(("KVLAYOUT_WITH_CUDA", None))
        return cpp_extension.CUDAExtension(
            "kvlayout._C",
            sources,
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
            extra_link_args=link_flags,
        )

    if _want_sycl():
        sources += _sources("sycl/*.sycl")
        define_macros.append(("KVLAYOUT_WITH_SYCL", None))
        return cpp_extension.SyclExtension(
            "kvlayout._C",
            sources,
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx_flags, "sycl": ["-O3"]},
            extra_link_args=link_flags,
        )

    return cpp_extension.CppExtension(
        "kvlayout._C",
        sources,
        include_dirs=include_dirs,
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_flags,
    )


class BuildExt(cpp_extension.BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)):
    """torch's build, skipped in place when :func:`native_status` says the library is current; stamps a build."""

    def run(self):
        in_place = self.inplace or getattr(self, "editable_mode", False)
        current, why = native_status()
        if in_place and current:
            print(f"kvlayout: native extension not rebuilt: {why}")
            return
        if shutil.which("ninja") is None:
            print("kvlayout: ninja not found, building without it (slower)")
        # the sources as they are when the compilers read them: a file edited during the build is not stamped
        fingerprint = native_fingerprint()
        super().run()
        if in_place and os.path.exists(built_library()):
            with open(STAMP, "w", encoding="utf-8") as f:
                f.write(fingerprint + "\n")


if __name__ == "__main__":   # setuptools runs this file as __main__; `kvlayout_setup` imports it for the stamp
    os.environ.setdefault("MAX_JOBS", str(max(1, os.cpu_count() or 1)))
    setup(ext_modules=[_extension()], cmdclass={"build_ext": BuildExt})
