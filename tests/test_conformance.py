"""The conformance runner itself: it passes on the real ops, fails on a broken one, names absent devices."""

import json
import os
import pathlib
import shlex

import pytest
import torch

from kvlayout.conformance import environment, runner
from kvlayout.ops import planner, programs


def _run(tmp_path, *args):
    report = tmp_path / "report"
    code = runner.main(["--jobs", "1", "--no-progress", "--report", str(report), *args])
    files = sorted(os.listdir(report))
    name = files[0].rsplit(".", 1)[0]
    with open(report / f"{name}.json", encoding="utf-8") as f:
        data = json.load(f)
    markdown = (report / f"{name}.md").read_text(encoding="utf-8")
    return code, files, data, markdown


def test_tiny_cpu_run_passes_and_writes_both_reports(tmp_path, capsys):
    code, files, data, markdown = _run(tmp_path, "--device", "cpu", "--examples", "2", "--seed", "1")
    assert files == ["cpu.json", "cpu.md"]
    assert data["summary"]["failed"] == 0, json.dumps(data["failures"], indent=1)[:4000]
    assert code == 0
    assert data["summary"]["status"] == "PASS"
    families = {r["family"] for r in data["results"]}
    assert families == {"transfer", "prepared", "staged", "gather", "scatter", "move", "pages", "rope", "fuzz_index",
                        "bad_input", "hostile"}
    assert data["environment"]["torch"] == torch.__version__
    assert data["environment"]["source_digest"] == environment.source_digest()
    assert any(d["device"] == "xpu" and d["status"] == "not run" for d in data["devices"])
    assert "# kvlayout conformance report: cpu" in markdown and "| transfer |" in markdown
    out = capsys.readouterr().out
    assert "kvlayout conformance: PASS" in out and "family" in out


def _swap_first_two_destination_segments(launches):
    """A broken planner: the first two (layer, plane) destinations of each launch trade places."""
    def broken(*args, **kwargs):
        planned = launches(*args, **kwargs)
        for launch in planned:
            seg = launch[3][1]
            if len(seg) >= 2:
                seg[0], seg[1] = seg[1], seg[0]
        return planned
    return broken


def test_runner_catches_a_broken_op_and_reduces_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(planner, "launches", _swap_first_two_destination_segments(planner.launches))
    programs.clear_unpinned()                    # programs planned before the fault was put in place
    monkeypatch.setattr(runner, "MAX_SHRUNK_GROUPS", 1)
    code, _, data, markdown = _run(tmp_path, "--device", "cpu", "--only", "transfer", "--examples", "12",
                                   "--shrink-seconds", "20")
    assert code == 1
    assert data["summary"]["failed"] > 0 and data["summary"]["status"] == "FAIL"
    reduced = [f for f in data["failures"] if f["reduced"]]
    assert reduced, "no failure was shrunk"
    command = reduced[0]["reproducer"]
    assert command.startswith("kvlayout conformance --device cpu --replay ")
    assert "```bash" in markdown and "Minimal case" in markdown
    # The reproducer is the sample's repr and the one replay driver: it fails with the fault in place and
    # passes without it.
    sample = shlex.split(command)[-1]
    assert sample.startswith("TransferSample(")
    assert runner.main(["--device", "cpu", "--replay", sample]) == 1
    monkeypatch.undo()
    programs.clear_unpinned()
    assert runner.main(["--device", "cpu", "--replay", sample]) == 0
    assert "PASS" in capsys.readouterr().out


def test_replay_takes_only_a_sample():
    from kvlayout.conformance.families import parse_sample

    with pytest.raises(ValueError):
        parse_sample("__import__('os').system('true')")
    with pytest.raises(ValueError):
        parse_sample("Geometry(P=1, L=1, NB=1, BS=1, H=1, E=1)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
def test_absent_device_is_reported_not_present(tmp_path):
    code, _, data, markdown = _run(tmp_path, "--device", "cuda", "--examples", "1")
    assert code == 2
    cuda = next(d for d in data["devices"] if d["device"] == "cuda")
    assert cuda["status"] == "not present"
    assert data["summary"]["cases"] == 0
    assert "cuda: not present" in markdown


def test_device_list_and_family_selection():
    assert environment.parse_devices("all") == ["cpu", "cuda", "xpu"]
    assert environment.parse_devices("cuda, cpu,cuda") == ["cuda", "cpu"]
    assert runner.select_families("bad_*,move") == ["move", "bad_input"]
    with pytest.raises(SystemExit):
        runner.select_families("nothing")


def test_sanitizer_absent_is_not_a_pass(monkeypatch):
    monkeypatch.setattr(runner, "find_sanitizer", lambda: None)

    class Args:
        sanitize_examples, seed = 2, 0

    assert runner.sanitize(Args, cuda_ran=True)["status"] == "sanitizer not available"
    assert runner.sanitize(Args, cuda_ran=False)["status"] == "not run"


def test_the_source_digest_names_the_code_not_the_copy(tmp_path):
    """Two copies of the tree have one digest whatever lies beside the code (records, caches, a .git); one byte
    of code, one code file more, or a file moved changes it."""
    import shutil

    root = pathlib.Path(environment.__file__).resolve().parents[1]
    copy = tmp_path / "tree"
    for name in environment.SOURCE_DIRS:
        shutil.copytree(root / name, copy / name, ignore=shutil.ignore_patterns("*.so", "results", "reports"))
    for name in environment.SOURCE_FILES:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / name, copy / name)
    digest = environment.source_digest(str(copy))
    assert digest == environment.source_digest(str(root)) and len(digest) == 12
    (copy / ".git").mkdir()
    (copy / ".git" / "HEAD").write_text("ref: refs/heads/old\n")
    (copy / "bench" / "results").mkdir(exist_ok=True)
    (copy / "bench" / "results" / "run.jsonl").write_text("{}\n")
    (copy / "ops" / "__pycache__").mkdir(exist_ok=True)
    (copy / "ops" / "__pycache__" / "stale.py").write_text("x = 1\n")
    assert environment.source_digest(str(copy)) == digest
    source = copy / "torch_ext" / "slots.cpp"
    source.write_bytes(source.read_bytes() + b" ")
    changed = environment.source_digest(str(copy))
    assert changed != digest
    (copy / "ops" / "extra.py").write_text("")
    assert environment.source_digest(str(copy)) not in (digest, changed)
    (copy / "ops" / "extra.py").rename(copy / "compat" / "extra.py")
    assert environment.source_digest(str(copy)) not in (digest, changed)


def test_the_source_digest_reads_every_package_directory():
    import tomllib

    root = pathlib.Path(environment.__file__).resolve().parents[1]
    with open(root / "pyproject.toml", "rb") as f:
        package_dirs = set(tomllib.load(f)["tool"]["setuptools"]["package-dir"].values())
    assert package_dirs <= set(environment.SOURCE_DIRS), package_dirs - set(environment.SOURCE_DIRS)
