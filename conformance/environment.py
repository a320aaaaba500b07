"""Devices to test and the environment a conformance run records.

:func:`devices` turns the requested device list into one status per device:
``run`` (present and kvlayout's kernels for it are built), ``not present`` (no
such device here), or ``not run`` (with the reason: XPU has no build and no
device on these machines).  Nothing requested is skipped silently.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import subprocess
import sys

KNOWN_DEVICES = ("cpu", "cuda", "xpu")


@dataclasses.dataclass
class DeviceStatus:
    device: str
    status: str          # "run", "not present", "not run"
    reason: str = ""
    name: str = ""       # e.g. the GPU's name

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def parse_devices(text: str) -> list[str]:
    """``"cpu,cuda"`` / ``"all"`` -> device kinds, in order, without repeats."""
    out = []
    for item in (t.strip().lower() for t in text.split(",")):
        if not item:
            continue
        for d in (KNOWN_DEVICES if item == "all" else (item,)):
            if d not in out:
                out.append(d)
    return out


def devices(requested: list[str]) -> list[DeviceStatus]:
    """The status of each requested device."""
    import torch

    from kvlayout.ops import _native

    built = _native.built_backends()
    out = []
    for d in requested:
        if d == "cpu":
            out.append(DeviceStatus("cpu", "run", name=cpu_name()))
        elif d == "cuda":
            if not torch.cuda.is_available():
                why = (f"torch {torch.__version__} was built without CUDA" if not torch.version.cuda
                       else "torch.cuda.is_available() is False (no GPU visible)")
                out.append(DeviceStatus("cuda", "not present", f"no CUDA device: {why}"))
            elif "cuda" not in built:
                out.append(DeviceStatus("cuda", "not run", "a CUDA device is present but kvlayout._C was built "
                                        "without CUDA kernels (rebuild with nvcc available)",
                                        torch.cuda.get_device_name()))
            else:
                out.append(DeviceStatus("cuda", "run", name=torch.cuda.get_device_name()))
        elif d == "xpu":
            xpu = getattr(torch, "xpu", None)
            present = bool(xpu is not None and xpu.is_available())
            if present and "xpu" in built:
                out.append(DeviceStatus("xpu", "run", name=str(xpu.get_device_name())))
            else:
                why = []
                if not present:
                    why.append("no XPU device (torch.xpu.is_available() is False)")
                if "xpu" not in built:
                    why.append("kvlayout._C built without SYCL kernels")
                out.append(DeviceStatus("xpu", "not run" if not present else "not run",
                                        "XPU conformance was not run: " + "; ".join(why)))
        else:
            out.append(DeviceStatus(d, "not present", f"unknown device kind {d!r} (known: {', '.join(KNOWN_DEVICES)})"))
    return out


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def git_commit() -> dict:
    """The commit of the kvlayout source tree (when it is a git checkout) and whether tracked files changed."""
    import kvlayout

    root = os.path.dirname(os.path.dirname(os.path.abspath(kvlayout.__file__)))
    if not os.path.isdir(os.path.join(root, ".git")) or not shutil.which("git"):
        return {"commit": None, "modified": None}
    commit = _run(["git", "-C", root, "rev-parse", "HEAD"]) or None
    status = _run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"])
    return {"commit": commit, "modified": bool(status) if commit else None}


# What the digest reads: the package's directories (pyproject.toml's package-dir), the scripts that make records,
# the build's files and the bench's peer figures; of the directories, the source files only (not the records kept
# beside them)
SOURCE_DIRS = ("kvlayout", "reference", "ops", "conformance", "compat", "bench", "distributed", "torch_ext", "scripts")
SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".cu", ".sycl", ".sh")
SOURCE_FILES = ("setup.py", "pyproject.toml", "bench/peers.json")


def source_digest(root: str | None = None) -> str:
    """A digest of the source tree's contents (12 hex digits), that names the code a record ran whatever the
    copy's ``.git`` says: equal trees, equal digests. ``root``: the tree (default: the installed kvlayout's).

    Compare a record's with ``python -m kvlayout.conformance.environment [ROOT]`` on a checkout of a commit."""
    import hashlib

    if root is None:
        import kvlayout

        root = os.path.dirname(os.path.dirname(os.path.abspath(kvlayout.__file__)))
    paths = [f for f in SOURCE_FILES if os.path.isfile(os.path.join(root, f))]
    for top in SOURCE_DIRS:
        for folder, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            paths += [os.path.relpath(os.path.join(folder, f), root) for f in files if f.endswith(SOURCE_SUFFIXES)]
    digest = hashlib.sha256()
    for path in sorted(p.replace(os.sep, "/") for p in paths):
        with open(os.path.join(root, path), "rb") as f:
            content = f.read()
        digest.update(f"{path}\0{len(content)}\0".encode())
        digest.update(content)
    return digest.hexdigest()[:12]


def collect(statuses: list[DeviceStatus]) -> dict:
    """Versions, machine and devices."""
    import hypothesis
    import jax
    import numpy
    import torch

    import kvlayout
    from kvlayout.ops import _native

    env = {
        "kvlayout": kvlayout.__version__,
        **{f"git_{k}": v for k, v in git_commit().items()},
        "source_digest": source_digest(),
        "kvlayout_backends": _native.built_backends(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "jax": jax.__version__,
        "jax_platforms": os.environ.get("JAX_PLATFORMS", ""),
        "numpy": numpy.__version__,
        "hypothesis": hypothesis.__version__,
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
    }
    if any(s.device == "cuda" and s.status == "run" for s in statuses):
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env["gpu"] = props.name
        env["gpu_capability"] = f"{props.major}.{props.minor}"
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        smi = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]) \
            if shutil.which("nvidia-smi") else ""
        env["driver"] = smi.splitlines()[0].split(",")[-1].strip() if smi else _driver_from_torch()
    return env


def _driver_from_torch() -> str | None:
    try:
        import torch

        return str(torch.cuda.driver_version()) if hasattr(torch.cuda, "driver_version") else None
    except Exception:
        return None


def report_name(statuses: list[DeviceStatus]) -> str:
    """``h200`` when an H200 was tested, else the accelerator kind, else ``cpu``."""
    ran = [s for s in statuses if s.status == "run"]
    for s in ran:
        if s.device == "cuda":
            return "h200" if "H200" in s.name.upper() else "cuda"
    for s in ran:
        if s.device != "cpu":
            return s.device
    return "cpu"


if __name__ == "__main__":
    print(source_digest(sys.argv[1] if len(sys.argv) > 1 else None))
