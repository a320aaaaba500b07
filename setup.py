"""Build of kvlayout's native extension, kvlayout._C.

CPU sources are always built. CUDA sources are added when torch was built
with CUDA and nvcc is found (CUDA_HOME), unless KVLAYOUT_FORCE_CPU_ONLY=1.
SYCL sources are added when torch has XPU and icpx is on PATH. CUDA targets
sm_90 + PTX by default; TORCH_CUDA_ARCH_LIST overrides it.

The extension must link the same shared libstdc++ as torch. A toolchain
that links libstdc++ statically into shared objects (CXX pointing at such a
g++) produces a _C.so that crashes on its first formatted error message;
build with the system compiler then (CXX=/usr/bin/g++ CC=/usr/bin/gcc).
"""

import glob
import os
import shutil

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


def _extension():
    include_dirs = [os.path.join(ROOT, EXT, "include"), os.path.join(ROOT, EXT)]
    sources = _sources("registration.cpp", "python_module.cpp", "program.cpp", "copy_plan.cpp", "slots.cpp",
                       "rope_plan.cpp", "device_args.cpp", "cpu/*.cpp")
    cxx_flags = ["-O3", "-std=c++17"]
    define_macros = []

    if _want_cuda():
        sources += _sources("cuda/*.cu")
        nvcc_flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]
        if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            nvcc_flags += [
                "-gencode", "arch=compute_90,code=sm_90",
                "-gencode", "arch=compute_90,code=compute_90",
            ]
        define_macros.append(("KVLAYOUT_WITH_CUDA", None))
        return cpp_extension.CUDAExtension(
            "kvlayout._C",
            sources,
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
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
        )

    return cpp_extension.CppExtension(
        "kvlayout._C",
        sources,
        include_dirs=include_dirs,
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags},
    )


if shutil.which("ninja") is None:
    print("kvlayout: ninja not found, building without it (slower)")
os.environ.setdefault("MAX_JOBS", str(max(1, os.cpu_count() or 1)))

setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)},
)
