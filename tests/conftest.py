"""Shared pytest setup: CPU-only JAX oracle, device-generic tests, hypothesis profile.

* The reference (JAX) is the oracle and runs on the CPU: ``JAX_PLATFORMS=cpu``
  is set before anything imports jax, so on a GPU machine jax neither grabs
  GPU memory nor competes with the kernels under test.
* ``devices``: ``["cpu"]`` plus ``"cuda"`` when a CUDA device is present.  A
  test that takes the ``device`` fixture runs once per device (like PyTorch's
  device-generic tests); ``cuda_device`` runs on CUDA only (skipped
  elsewhere).  A test may still parametrize ``device`` itself.
* Hypothesis: profile ``kvlayout`` (no deadline, no example database, slow
  data allowed).  Tests size their example counts with
  ``torch_cases.examples(n)``; ``KVLAYOUT_HYPOTHESIS_EXAMPLES=k`` multiplies
  them by k (e.g. a long conformance run on a GPU machine).
* Under pytest-xdist (``-n N``) each worker sizes its thread pools to its
  share of the cores (at least two threads, so the CPU kernel's split over
  threads still runs) and compiles ``torch.compile``'s code in its own
  process: N workers each starting a pool of every core's size (torch's
  threads, inductor's compile workers) oversubscribe the machine many times.
  A variable already set is left as it is.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _threads_per_worker() -> int | None:
    """This pytest-xdist worker's share of the cores (at least 2), or None outside xdist."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    return max(2, (os.cpu_count() or 1) // workers) if workers > 1 else None


_share = _threads_per_worker()
if _share is not None:   # (before torch is imported: OpenMP reads its variable once)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

if _share is not None:   # (torch also reads it at import; set here in case a plugin imported torch first)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

settings.register_profile(
    "kvlayout",
    deadline=None,
    database=None,
    max_examples=10,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                           HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "kvlayout"))


@pytest.fixture(autouse=True)
def _auto_by_its_fixed_rule(monkeypatch):
    """engine="auto" by its fixed rule in every test: no device calibration is probed or kept across tests, so
    that no test's engine depends on how fast this machine's SMs move host memory (the calibration's tests set
    their own)."""
    from kvlayout.ops import calibration
    monkeypatch.setattr(calibration, "LAZY", False)
    monkeypatch.setattr(calibration, "_results", {})


@pytest.fixture(params=devices)
def device(request) -> str:
    """Each device kvlayout can run on here: ``"cpu"``, and ``"cuda"`` where present."""
    return request.param


@pytest.fixture
def cuda_device() -> str:
    """``"cuda"``; the test is skipped where there is no CUDA device."""
    if "cuda" not in devices:
        pytest.skip("no CUDA device")
    return "cuda"


@pytest.fixture(scope="session")
def walk_lib(tmp_path_factory):
    """The device kernel's walk (torch_ext/include/kvlayout/copy_rows_kernel.h) compiled for the host
    (tests/native/walk_emulator.cpp), once per session; skipped without a host C++ compiler."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no host C++ compiler")
    root = Path(__file__).resolve().parents[1]
    out = tmp_path_factory.mktemp("walk") / "walk_emulator.so"
    # under scripts/sanitize_cpu.sh the device walk is instrumented too: a load or store of the emulated
    # kernel outside its buffers is then a report, not only a wrong byte
    sanitize = os.environ.get("KVLAYOUT_TEST_SANITIZE", "")
    flags = [f"-fsanitize={sanitize}", "-fno-sanitize-recover=all", "-g"] if sanitize else []
    subprocess.run([compiler, "-std=c++17", "-O1", "-shared", "-fPIC", *flags, f"-I{root / 'torch_ext' / 'include'}",
                    str(root / "tests" / "native" / "walk_emulator.cpp"), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.kvl_emulate_walk.argtypes = [p, p, p, i64, p, i64, i32, i64, i64, i64, p, p, p, p,
                                     i64, i64, i32, i32, i64, p]
    lib.kvl_emulate_walk.restype = ctypes.c_int
    lib.kvl_fast_divmod.argtypes = [i64, i64, i64, p, p]
    lib.kvl_wait_counts.argtypes = [p]
    lib.kvl_walk_unrolls.argtypes = [p]
    lib.kvl_set_recording.argtypes = [i64, i64]
    lib.kvl_set_row_word.argtypes = [i32]
    lib.kvl_max_walk_count.restype = ctypes.c_int64
    return lib


def pytest_report_header(config):
    return f"kvlayout devices: {', '.join(devices)} (torch {torch.__version__})"
