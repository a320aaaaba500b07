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
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

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


def pytest_report_header(config):
    return f"kvlayout devices: {', '.join(devices)} (torch {torch.__version__})"
