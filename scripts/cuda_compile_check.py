"""Compiles kvlayout's CUDA sources on a machine without a GPU, and reports what ptxas made of each kernel.

    .venv/bin/python scripts/cuda_compile_check.py [--registers] [--jobs N] [FILE.cu ...]

Each ``torch_ext/cuda/*.cu`` (or the files named) is compiled to an object file with the flags ``setup.py``
builds the extension with (its ``NVCC_FLAGS`` and ``NVCC_DEFAULT_ARCHES``), against the headers of the
installed torch, so a change to a kernel or its launcher is known to compile before a device machine builds it.
A CPU-only torch wheel ships the ATen CUDA headers but not every header they include, and a minimal CUDA
toolkit lacks the math libraries' ones; the declarations those headers need of cuBLAS, cuSPARSE and cuSOLVER
(kvlayout calls none of them) come from stub headers made for the run, only where the real ones are missing.

``--registers``: per kernel instance, the registers, spilled bytes and shared memory ptxas reports (what sets
how many CTAs an SM holds), demangled. Exit status: 0 when every file compiled, 1 when one did not (its
errors are printed), 2 when there is no nvcc.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What torch's CUDA headers need of libraries kvlayout does not call, where the toolkit has no header for them.
STUBS = {
    "cusparse.h": "typedef struct cusparseContext* cusparseHandle_t;\ntypedef int cusparseStatus_t;\n",
    "cublas_v2.h": "typedef struct cublasContext* cublasHandle_t;\ntypedef int cublasStatus_t;\n",
    "cublasLt.h": "typedef struct cublasLtContext* cublasLtHandle_t;\n",
    "cusolverDn.h": "typedef struct cusolverDnContext* cusolverDnHandle_t;\n",
    "cusolver_common.h": "typedef int cusolverStatus_t;\n",
}
# Made by torch's CMake configure step; CPU wheels leave it out.
CMAKE_MACROS = os.path.join("c10", "cuda", "impl", "cuda_cmake_macros.h")


def setup_nvcc_flags() -> list[str]:
    """``NVCC_FLAGS + NVCC_DEFAULT_ARCHES`` as ``setup.py`` assigns them (read, not run: importing setup.py
    would build)."""
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    assigned = {t.id: node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    missing = [name for name in ("NVCC_FLAGS", "NVCC_DEFAULT_ARCHES") if name not in assigned]
    if missing:
        raise SystemExit(f"cuda_compile_check: setup.py assigns no {', '.join(missing)}")
    return list(ast.literal_eval(assigned["NVCC_FLAGS"])) + list(ast.literal_eval(assigned["NVCC_DEFAULT_ARCHES"]))


def find_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidate = os.path.join(home, "bin", "nvcc") if home else None
    return candidate if candidate and os.path.exists(candidate) else shutil.which("nvcc")


def include_dirs(nvcc: str, stubs: str) -> list[str]:
    """The extension's own, torch's, Python's, and the stubs (last: real headers win)."""
    import torch

    torch_include = os.path.join(os.path.dirname(torch.__file__), "include")
    cuda_include = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include")
    for name, text in STUBS.items():
        if not os.path.exists(os.path.join(cuda_include, name)):
            with open(os.path.join(stubs, name), "w", encoding="utf-8") as f:
                f.write(text)
    if not os.path.exists(os.path.join(torch_include, CMAKE_MACROS)):
        os.makedirs(os.path.join(stubs, os.path.dirname(CMAKE_MACROS)), exist_ok=True)
        with open(os.path.join(stubs, CMAKE_MACROS), "w", encoding="utf-8") as f:
            f.write("#define C10_CUDA_BUILD_SHARED_LIBS\n")
    return [os.path.join(ROOT, "torch_ext", "include"), os.path.join(ROOT, "torch_ext"), torch_include,
            os.path.join(torch_include, "torch", "csrc", "api", "include"), sysconfig.get_paths()["include"],
            stubs]


def compile_one(nvcc: str, source: str, flags: list[str], includes: list[str], out_dir: str,
                registers: bool) -> tuple[str, int, str]:
    obj = os.path.join(out_dir, os.path.basename(source) + ".o")
    cmd = [nvcc, *flags, "-DKVLAYOUT_WITH_CUDA", "-c", source, "-o", obj, *(f"-I{d}" for d in includes)]
    if registers:
        cmd += ["-Xptxas", "-v"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    return source, done.returncode, done.stdout + done.stderr


def kernel_table(ptxas: str) -> list[str]:
    """One line per kernel instance: registers, spilled bytes (stores/loads), shared memory; demangled."""
    rows, name, spill = [], None, (0, 0)
    for line in ptxas.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            name = m.group(1)
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            spill = (int(m.group(1)), int(m.group(2)))
            continue
        m = re.search(r"Used (\d+) registers.*?(\d+) bytes smem", line) or re.search(r"Used (\d+) registers", line)
        if m and name:
            smem = int(m.group(2)) if m.lastindex and m.lastindex >= 2 else 0
            rows.append((name, int(m.group(1)), spill, smem))
            name, spill = None, (0, 0)
    if not rows:
        return []
    names = [r[0] for r in rows]
    filt = shutil.which("c++filt")
    if filt:
        names = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    out = []
    for demangled, (_, regs, (st, ld), smem) in zip(names, rows):
        demangled = re.sub(r"\(anonymous namespace\)::|kvlayout::", "", demangled)
        out.append(f"  {regs:4d} registers  spill {st:4d}/{ld:<4d} B  smem {smem:6d} B  {demangled}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="CUDA sources (default: torch_ext/cuda/*.cu)")
    parser.add_argument("--registers", action="store_true", help="report ptxas's registers and spills per kernel")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    nvcc = find_nvcc()
    if nvcc is None:
        print("cuda_compile_check: no nvcc (set CUDA_HOME or put nvcc on PATH)", file=sys.stderr)
        return 2
    sources = args.files or sorted(os.path.join("torch_ext", "cuda", f)
                                   for f in os.listdir(os.path.join(ROOT, "torch_ext", "cuda")) if f.endswith(".cu"))
    flags = setup_nvcc_flags()
    failed = 0
    with tempfile.TemporaryDirectory() as scratch:
        includes = include_dirs(nvcc, scratch)
        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            results = list(pool.map(lambda s: compile_one(nvcc, s, flags, includes, scratch, args.registers),
                                    sources))
    for source, rc, output in results:
        errors = [line for line in output.splitlines() if "error" in line]
        print(f"{source}: {'compiled' if rc == 0 else 'FAILED'}")
        if rc != 0:
            failed += 1
            print("\n".join(errors or output.splitlines()[-20:]))
        elif args.registers:
            for line in kernel_table(output):
                print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
