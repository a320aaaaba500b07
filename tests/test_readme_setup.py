"""The README's set-up, ``scripts/setup.sh``: a line per phase, and no native rebuild when nothing native changed.

setup.py keeps the fingerprint of what the in-place library was built from (the files under torch_ext/,
setup.py, the torch version, the build choices) in ``kvlayout/_C.build-stamp``; an in-place or editable build
with a matching fingerprint and the library present does not compile.  These tests work on copies of the
build files in a temporary folder, with a stand-in library file: nothing is compiled.
"""

from __future__ import annotations

import os
import pathlib
import runpy
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("kvlayout", "reference", "ops", "conformance", "compat", "bench", "distributed")


def _copy_tree(dest: pathlib.Path, with_packages: bool = False) -> pathlib.Path:
    """setup.py, pyproject.toml, README.md, torch_ext/ and scripts/ (and the package folders) under ``dest``, with
    a stand-in for the built library."""
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "_C.build-stamp")
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    for name in ("torch_ext", "scripts") + (PACKAGES if with_packages else ()):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    (dest / "kvlayout").mkdir(exist_ok=True)
    (dest / "kvlayout" / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))).write_bytes(b"stand-in library")
    return dest


def _setup_module(root: pathlib.Path) -> dict:
    return runpy.run_path(str(root / "setup.py"), run_name="kvlayout_setup")


def _stamp(root: pathlib.Path) -> None:
    setup = _setup_module(root)
    pathlib.Path(setup["STAMP"]).write_text(setup["native_fingerprint"]() + "\n")


def test_native_status_follows_sources_torch_and_the_library(tmp_path, monkeypatch):
    root = _copy_tree(tmp_path)
    monkeypatch.delenv("KVLAYOUT_REBUILD", raising=False)
    assert _setup_module(root)["native_status"]()[0] is False            # never stamped
    _stamp(root)
    assert _setup_module(root)["native_status"]()[0] is True
    monkeypatch.setenv("KVLAYOUT_REBUILD", "1")
    assert _setup_module(root)["native_status"]() == (False, "KVLAYOUT_REBUILD=1")
    monkeypatch.delenv("KVLAYOUT_REBUILD")
    source = next(p for p in sorted((root / "torch_ext").rglob("*.cpp")))
    source.write_text(source.read_text() + "\n// changed\n")
    current, why = _setup_module(root)["native_status"]()
    assert not current and "changed" in why
    _stamp(root)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")                      # another build choice
    assert _setup_module(root)["native_status"]()[0] is False
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    (root / "kvlayout" / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))).unlink()
    assert _setup_module(root)["native_status"]()[0] is False


def test_editable_build_skips_an_unchanged_extension(tmp_path):
    """What ``pip install -e .`` runs (setuptools' build_editable): with a current stamp it compiles nothing and
    leaves the library alone."""
    (tmp_path / "tree").mkdir()
    root = _copy_tree(tmp_path / "tree", with_packages=True)
    _stamp(root)
    library = root / "kvlayout" / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))
    code = "from setuptools import build_meta; build_meta.build_editable(%r)" % str(tmp_path / "wheel")
    env = dict(os.environ)
    env.pop("KVLAYOUT_REBUILD", None)
    done = subprocess.run([sys.executable, "-c", code], cwd=str(root), capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kvlayout: native extension not rebuilt" in done.stdout + done.stderr
    assert library.read_bytes() == b"stand-in library"
    assert not (root / "build").exists() or not list((root / "build").rglob("*.o"))


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_setup_script_says_each_phase_and_whether_it_builds(tmp_path):
    """setup.sh against a stand-in venv: its python is this interpreter, its pip records what it is asked."""
    root = _copy_tree(tmp_path)
    venv_bin = root / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    (venv_bin / "pip").write_text(f"#!/bin/sh\necho \"$@\" >> {root / 'pip.log'}\n")
    for exe in ("python", "pip"):
        (venv_bin / exe).chmod(0o755)
    env = dict(os.environ)
    env.pop("KVLAYOUT_REBUILD", None)

    def setup_sh() -> list[str]:
        done = subprocess.run(["bash", str(root / "scripts" / "setup.sh")], capture_output=True, text=True,
                              env=env, timeout=300)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines and all(line.startswith("setup: ") for line in lines), done.stdout
        return lines

    first = setup_sh()
    assert first[0] == "setup: reusing the virtual environment .venv"
    assert any("torch==" in line for line in first)
    assert any("building the native extension" in line for line in first)
    assert "pytest" in first[-1]                                       # after the first time, pytest alone
    assert "-e .[test,bench]" in (root / "pip.log").read_text()       # matplotlib comes with the bench extra
    _stamp(root)
    assert any("native extension not rebuilt" in line for line in setup_sh())


def test_bench_extra_brings_matplotlib():
    tomllib = pytest.importorskip("tomllib")

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(dep.startswith("matplotlib") for dep in project["optional-dependencies"]["bench"])
    assert ".[test,bench]" in (ROOT / "scripts" / "setup.sh").read_text()
