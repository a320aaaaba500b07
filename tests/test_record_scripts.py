"""scripts/cuda_record.sh, the record a CUDA machine hands back: each step's log, its time in steps.txt, and each
report folder packed into one STEP.tgz. Run here with a stand-in interpreter that writes what the real steps
write, so the packing is checked without a GPU."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Stands in for python: `-m kvlayout conformance|bench ... --report|--out DIR` writes two report files into DIR
# (named after the command, so that two runs into one folder are told apart); `-c` prints a header line.
STAND_IN = """#!/usr/bin/env bash
if [ "$1" = -c ]; then echo "torch (stand-in)"; exit 0; fi
prev=
for a in "$@"; do
    if [ "$prev" = --out ] || [ "$prev" = --report ]; then dir=$a; fi
    prev=$a
done
what=$3
case " $* " in *" --ncu "*) what=${what}_ncu ;; esac
if [ -n "${dir:-}" ]; then
    mkdir -p "$dir" && echo '{"kind": "case"}' > "$dir/$what.jsonl" && echo "| $what |" > "$dir/$what.md"
fi
echo "ran $*"
echo "staged graphs=${KVLAYOUT_STAGED_GRAPHS:-} chunks=${KVLAYOUT_STAGED_CHUNKS:-}"   # (a row of the bench's table)
"""


@pytest.fixture
def stand_in(tmp_path: Path) -> Path:
    py = tmp_path / "python"
    py.write_text(STAND_IN)
    py.chmod(0o755)
    return py


def record(out: Path, python: Path, *steps: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=str(python))
    return subprocess.run(["bash", str(ROOT / "scripts" / "cuda_record.sh"), str(out), *steps], env=env,
                          capture_output=True, text=True, timeout=60)


def members(archive: Path) -> set[str]:
    with tarfile.open(archive) as t:
        return {os.path.normpath(m.name) for m in t.getmembers() if m.isfile()}


def test_each_report_folder_comes_back_as_one_archive(tmp_path: Path, stand_in: Path):
    out = tmp_path / "out"
    done = record(out, stand_in, "conformance", "bench", "ncu")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "bench.tgz", "bench.txt", "conformance.tgz", "conformance.txt", "ncu.tgz", "ncu.txt", "steps.txt"]
    assert members(out / "bench.tgz") == {"bench.jsonl", "bench.md"}
    assert members(out / "conformance.tgz") == {"conformance.jsonl", "conformance.md"}
    assert members(out / "ncu.tgz") == {"bench_ncu.jsonl", "bench_ncu.md"}
    steps = (out / "steps.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in steps] == ["conformance", "bench", "ncu"]
    assert all(": exit 0 in " in line for line in steps)
    assert "--only" not in (out / "ncu.txt").read_text()
    env = dict(os.environ, PYTHON=str(stand_in), NCU_ONLY="from_host")    # a run's counters split over calls
    subprocess.run(["bash", str(ROOT / "scripts" / "cuda_record.sh"), str(out), "ncu"], env=env, check=True,
                   capture_output=True, timeout=60)
    assert "--ncu --out " in (out / "ncu.txt").read_text() and " --only from_host" in (out / "ncu.txt").read_text()


def test_a_step_run_again_adds_to_its_archive_and_host_profile_reads_the_packed_record(tmp_path: Path,
                                                                                        stand_in: Path):
    out = tmp_path / "out"
    assert record(out, stand_in, "bench").returncode == 0
    # a second bench into the same folder: its files join the archive (here the same names: replaced)
    (out / "bench").mkdir()
    (out / "bench" / "extra.md").write_text("x")
    assert record(out, stand_in, "bench", "host-profile").returncode == 0
    assert members(out / "bench.tgz") == {"bench.jsonl", "bench.md", "extra.md"}
    log = (out / "host_profile.txt").read_text()
    # the profile ran on the record unpacked from bench.tgz, not on the committed one, of every call
    assert "--record" in log and "bench.jsonl" in log and "bench/results/h200.jsonl" not in log
    assert "--call " not in log                                   # (--calls is the call count)
    env = dict(os.environ, PYTHON=str(stand_in), HOST_PROFILE_CALL="transfer")   # only the replayed rows
    subprocess.run(["bash", str(ROOT / "scripts" / "cuda_record.sh"), str(out), "host-profile"], env=env,
                   check=True, capture_output=True, timeout=60)
    assert "--call transfer" in (out / "host_profile.txt").read_text()
    assert record(out, stand_in, "staged-timeline").returncode == 0
    ran = next(line for line in (out / "staged_timeline.txt").read_text().splitlines() if line.startswith("ran"))
    # the default keys (the stand-in echoes them space-separated): four rows, each staged
    assert ran.startswith("ran scripts/host_profile.py --timeline --calls 10 L32_H1_D128 T=4096")
    assert ran.count("all layers ctas=default staged") == 4 and "vllm_mla->lmcache_kv_mla to_host" in ran
    assert record(out, stand_in, "host-path", "binding-cost").returncode == 0
    assert "ran scripts/host_path.py --device cuda" in (out / "host_path.txt").read_text()
    assert "ran scripts/binding_cost.py --device cuda" in (out / "binding_cost.txt").read_text()


def test_ab_steps_build_the_older_tree_beside_the_others_and_hand_back_the_comparison(tmp_path: Path,
                                                                                      stand_in: Path):
    old = tmp_path / "old.tar.gz"                   # an older tree (here a stand-in with a package folder)
    tree = tmp_path / "tree"
    (tree / "kvlayout").mkdir(parents=True)
    (tree / "kvlayout" / "__init__.py").write_text("")
    with tarfile.open(old, "w:gz") as t:
        t.add(tree / "kvlayout", arcname="kvlayout")
    out, ab_dir = tmp_path / "out", tmp_path / "ab"
    env = dict(os.environ, PYTHON=str(stand_in), AB_OLD=str(old), AB_DIR=str(ab_dir), AB_ROUNDS="2")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "cuda_record.sh"), str(out), "ab-old", "bench", "ab"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "ab.txt", "ab_compare.txt", "ab_old_build.txt", "ab_runs.tgz", "bench.tgz", "bench.txt", "steps.txt"]
    steps = (out / "steps.txt").read_text().splitlines()
    assert steps[0].startswith("ab-old: building") and steps[-1].startswith("ab: exit 0")
    assert (ab_dir / "old-tree" / ".ab_built").read_text().strip() == str(old)
    # two rounds of (old, new), each compared: every run's record and terminal table in the archive
    runs = [f"{side}_{n}" for side in ("old", "new") for n in (1, 2)]
    assert members(out / "ab_runs.tgz") == {f"{r}/bench.{ext}" for r in runs for ext in ("jsonl", "md")} | {
        f"{r}.txt" for r in runs}
    compared = (out / "ab_compare.txt").read_text()
    assert compared.count("kvlayout.bench.compare --same-machine /") == 2          # each old run, every new run
    medians = [line for line in compared.splitlines() if "--medians 2" in line]   # then the medians, old vs new
    assert len(medians) == 1 and medians[0].index("old_2") < medians[0].index("new_1")


def test_staged_settings_run_each_setting_in_turn_every_round_and_keep_the_staged_rows(tmp_path: Path,
                                                                                        stand_in: Path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=str(stand_in), STAGED_ROUNDS="2")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "cuda_record.sh"), str(out), "staged-settings"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["staged-settings.tgz", "staged_settings.txt", "steps.txt"]
    log = (out / "staged_settings.txt").read_text().splitlines()
    log = log[next(i for i, line in enumerate(log) if line.startswith("$ ")) + 1:]    # (after the header)
    rows = [line for line in log if line.startswith("staged ")]
    assert rows == ["staged graphs=8 chunks=8", "staged graphs=0 chunks=8", "staged graphs=8 chunks=1"] * 2
    assert not any(line.startswith("ran ") for line in log)          # only the bench's staged rows are kept
    runs = {m.split(os.sep)[0] for m in members(out / "staged-settings.tgz")}
    assert len(runs) == 6 and all(r.endswith(("_1", "_2")) for r in runs)


def test_staged_settings_can_be_replaced_by_a_list_of_settings(tmp_path: Path, stand_in: Path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=str(stand_in), STAGED_ROUNDS="1",
               STAGED_SETTINGS="KVLAYOUT_STAGED_CHUNKS=8;KVLAYOUT_STAGED_GRAPHS=2 KVLAYOUT_STAGED_CHUNKS=4")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "cuda_record.sh"), str(out), "staged-settings"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    log = (out / "staged_settings.txt").read_text().splitlines()
    log = log[next(i for i, line in enumerate(log) if line.startswith("$ ")) + 1:]    # (after the header)
    rows = [line for line in log if line.startswith("staged ")]
    assert rows == ["staged graphs= chunks=8", "staged graphs=2 chunks=4"]
    assert {m.split(os.sep)[0] for m in members(out / "staged-settings.tgz")} == {
        "KVLAYOUT_STAGED_CHUNKS=8_1", "KVLAYOUT_STAGED_GRAPHS=2_KVLAYOUT_STAGED_CHUNKS=4_1"}


def test_lmcache_builds_beside_the_next_steps_and_the_side_by_side_waits_for_it(tmp_path: Path, stand_in: Path):
    """lmcache-ops runs in the background (so that "lmcache-ops build" builds both libraries at once); the
    side-by-side steps start once it ended; SIDE_NCU_SHAPES and SIDE_NCU_CALLS narrow the ncu step."""
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=str(stand_in), LMCACHE_SDIST="lmcache.tar.gz", SIDE_TOKENS="256",
               SIDE_NCU_SHAPES="L32_H1_D128", SIDE_NCU_CALLS="kvlayout kernel,LMCache")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "cuda_record.sh"), str(out), "lmcache-ops", "bench",
                           "side-by-side", "side-by-side-ncu"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    steps = [line.split(":")[0] for line in (out / "steps.txt").read_text().splitlines()]
    assert sorted(steps[:2]) == ["bench", "lmcache-ops"] and steps[2:] == ["side-by-side", "side-by-side-ncu"]
    assert "ran scripts/build_lmcache_ops.py lmcache.tar.gz /tmp/lmcache-ops" in (out / "lmcache_ops.txt").read_text()
    ncu = (out / "side_by_side_ncu.txt").read_text()
    assert "--shapes L32_H1_D128 --calls kvlayout kernel,LMCache" in ncu
    assert "--shapes" not in (out / "side_by_side.txt").read_text()
    failing = tmp_path / "failing"
    failing.write_text(STAND_IN.replace('echo "ran $*"', 'echo "ran $*"; case "$*" in *build_lmcache*) exit 3;; esac'))
    failing.chmod(0o755)
    env["PYTHON"] = str(failing)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "cuda_record.sh"), str(tmp_path / "out2"), "lmcache-ops"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "lmcache-ops: exit 3" in (tmp_path / "out2" / "steps.txt").read_text()


def test_the_boundary_step_runs_full_size_unless_told_its_thread_rounds(tmp_path: Path, stand_in: Path):
    """The boundary tests at full size (10,000 thread rounds, 100,000 soak calls), or BOUNDARY_ROUNDS thread
    rounds where a slow host could not finish 10,000 in one call."""
    done = record(tmp_path / "full", stand_in, "boundary")
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "full" / "boundary.txt").read_text()
    assert "KVLAYOUT_THREAD_ROUNDS=10000 KVLAYOUT_SOAK_CALLS=100000" in log and "tests/test_boundary.py -k cuda" in log
    env = dict(os.environ, PYTHON=str(stand_in), BOUNDARY_ROUNDS="2000")
    subprocess.run(["bash", str(ROOT / "scripts" / "cuda_record.sh"), str(tmp_path / "short"), "boundary"], env=env,
                   check=True, capture_output=True, timeout=60)
    assert "KVLAYOUT_THREAD_ROUNDS=2000 KVLAYOUT_SOAK_CALLS=100000" in (tmp_path / "short" / "boundary.txt").read_text()


def _log(path: Path, gpu_line: str, command: str, body: str = "") -> None:
    path.write_text(f"{gpu_line}\ntorch 2.11.0+cu130 cuda 13.0\nsource digest 0123456789ab\n$ {command}\n{body}")


def _archive(path: Path, files: dict[str, str]) -> None:
    with tarfile.open(path, "w:gz") as archive:
        for name, text in files.items():
            data = path.parent / f".{name.replace('/', '_')}"
            data.write_text(text)
            archive.add(data, arcname=name)
            data.unlink()


def test_file_record_puts_a_sittings_files_where_the_tree_keeps_records(tmp_path: Path):
    """scripts/file_record.py: the test logs to tests/logs, conformance's reports and terminal to
    conformance/reports, the bench's cuda.* named after the GPU, the side-by-side and every other log into
    bench/results/<gpu>_<tree>/, each call's steps.txt appended under the commands its logs name; a second
    filing of the same sitting writes nothing."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("file_record", ROOT / "scripts" / "file_record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    gpu = "NVIDIA H200, 580.159.04"
    first, second, root = tmp_path / "call1", tmp_path / "call2", tmp_path / "tree"
    first.mkdir(), second.mkdir(), root.mkdir()
    _log(first / "build.txt", gpu, "python3 -m pip install -e .")
    _log(first / "tests.txt", gpu, "python3 -m pytest -q tests", "2730 passed\n")
    _log(first / "side_by_side.txt", gpu, "python3 -m kvlayout.bench.side_by_side --tokens 256")
    _archive(first / "side-by-side.tgz", {"side_by_side.jsonl": "{}\n", "side_by_side.md": "| x |\n"})
    (first / "steps.txt").write_text("build: exit 0 in 84 s\ntests: exit 0 in 134 s\nside-by-side: exit 0 in 9 s\n")
    _log(second / "conformance.txt", gpu, "python3 -m kvlayout conformance --device cpu,cuda --sanitize")
    _archive(second / "conformance.tgz", {"cuda.json": "{}", "cuda.md": "# c\n"})
    _log(second / "bench.txt", gpu, "python3 -m kvlayout bench --device cuda")
    _archive(second / "bench.tgz", {"cuda.jsonl": "{}\n", "cuda.md": "# b\n", "cuda_tokens.png": "png"})
    _archive(second / "staged-settings.tgz", {"KVLAYOUT_STAGED_CHUNKS=1_1/cuda.md": "# s\n"})
    (second / "chunks_1").mkdir()
    (second / "chunks_1" / "staged_timeline.txt").write_text("timeline\n")
    (second / "steps.txt").write_text("conformance: exit 0 in 88 s\nbench: exit 0 in 201 s\n")
    assert module.gpu_tag([first, second]) == "h200"
    assert module.main(["abc1234", str(first), str(second), "--root", str(root)]) == 0
    record = root / "bench" / "results" / "h200_abc1234"
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == sorted([
        "tests/logs/h200_abc1234.txt", "conformance/reports/h200_abc1234.json",
        "conformance/reports/h200_abc1234.md", "conformance/reports/h200_abc1234_terminal.txt",
        *(f"bench/results/h200_abc1234/{name}" for name in (
            "build.txt", "side_by_side.txt", "side_by_side.jsonl", "side_by_side.md", "bench.txt", "h200.jsonl",
            "h200.md", "h200_tokens.png", "staged-settings/KVLAYOUT_STAGED_CHUNKS=1_1/cuda.md",
            "chunks_1/staged_timeline.txt", "steps.txt"))])
    assert (root / "tests" / "logs" / "h200_abc1234.txt").read_text().endswith("2730 passed\n")
    assert (record / "h200.md").read_text() == "# b\n"
    assert (record / "steps.txt").read_text() == (
        "# call 1 (call1)\n#   $ python3 -m pip install -e .\nbuild: exit 0 in 84 s\n"
        "#   $ python3 -m pytest -q tests\ntests: exit 0 in 134 s\n"
        "#   $ python3 -m kvlayout.bench.side_by_side --tokens 256\nside-by-side: exit 0 in 9 s\n"
        "# call 2 (call2)\n#   $ python3 -m kvlayout conformance --device cpu,cuda --sanitize\n"
        "conformance: exit 0 in 88 s\n#   $ python3 -m kvlayout bench --device cuda\nbench: exit 0 in 201 s\n")
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit, match="would overwrite"):
        module.main(["abc1234", str(second), "--root", str(root)])
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    (second / "bench.txt").write_text("no GPU named here\n")
    (second / "conformance.txt").write_text("nor here\n")
    with pytest.raises(SystemExit, match="give --gpu"):
        module.main(["other", str(second), "--root", str(root)])
