"""Files what ``scripts/cuda_record.sh`` handed back from a CUDA machine into the tree's record folders.

    python scripts/file_record.py TREE OUTDIR [OUTDIR ...] [--gpu h200] [--root .]

One sitting's OUTDIRs (one per call, in the order they ran) become the record ``<gpu>_<TREE>`` (``TREE``: the
commit the machine ran, e.g. ``031f2a8``; ``<gpu>``: the first word of the form ``[A-Z]<3 digits>`` in the GPU
name that heads each step's log, lower-cased, or ``--gpu``):

* ``tests.txt``, ``tests_fast.txt``, ``boundary.txt`` -> ``tests/logs/<record>.txt``, ``<record>_fast.txt``,
  ``<record>_boundary.txt``;
* ``conformance.tgz``'s ``cuda.{json,md}`` -> ``conformance/reports/<record>.{json,md}``, ``conformance.txt``
  -> ``conformance/reports/<record>_terminal.txt``;
* ``bench.tgz``, ``ncu.tgz`` -> ``bench/results/<record>/``, their ``cuda*`` files named after the GPU
  (``cuda.jsonl`` -> ``h200.jsonl``, ``cuda_ncu.md`` -> ``h200_ncu.md``), as ``kvlayout.bench.targets`` and the
  docs read them; ``side-by-side.tgz`` -> the same folder as it is; any other ``STEP.tgz`` -> its own
  ``STEP/`` folder there;
* every other step log (``build.txt``, ``bench.txt``, ``side_by_side.txt``, ...) and every subfolder -> that
  folder as they are;
* each OUTDIR's ``steps.txt`` -> ``steps.txt`` there, appended in turn, each step's line after the command its
  log names (the ``$ ...`` line under the log's header), so that the record says how each file was made.

Nothing is overwritten: a file already in place stops the run before anything is written (file a sitting once,
or name another tree). Prints where each file went.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

TEST_LOGS = {"tests.txt": "", "tests_fast.txt": "_fast", "boundary.txt": "_boundary"}
RENAMED_ARCHIVES = ("bench", "ncu")          # kvlayout bench's reports, named after the device type ("cuda")
AS_IS_ARCHIVES = ("side-by-side",)           # files named by what they hold


def gpu_tag(outdirs: list[Path]) -> str | None:
    """``h100``, ``h200``, ...: from the GPU name heading the first step log that has one."""
    for outdir in outdirs:
        for log in sorted(outdir.glob("*.txt")):
            if log.name == "steps.txt":
                continue
            first = log.read_text(errors="replace").split("\n", 1)[0]
            found = re.search(r"\b([A-Z]\d{3})\b", first.split(",")[0])
            if found:
                return found.group(1).lower()
    return None


def command_of(log: Path) -> str | None:
    """The command a step log names (its first ``$ `` line), if any."""
    for line in log.read_text(errors="replace").splitlines()[:8]:
        if line.startswith("$ "):
            return line[2:]
    return None


def archived_target(step: str, inner: Path, record: str, gpu: str, root: Path) -> Path:
    """Where file ``inner`` of ``STEP.tgz`` goes."""
    folder = root / "bench" / "results" / record
    if step == "conformance":
        return root / "conformance" / "reports" / (record + inner.suffix)
    if step in RENAMED_ARCHIVES and inner.name.startswith("cuda"):
        return folder / inner.parent / (gpu + inner.name[len("cuda"):])
    return folder / inner if step in RENAMED_ARCHIVES + AS_IS_ARCHIVES else folder / step / inner


def plan(outdirs: list[Path], record: str, gpu: str, root: Path, staging: Path) -> tuple[list[tuple[Path, Path]], str]:
    """(source, destination) of every file to copy (archives unpacked into ``staging`` first), and the record's
    steps.txt text."""
    folder = root / "bench" / "results" / record
    moves: list[tuple[Path, Path]] = []
    steps: list[str] = []
    for n, outdir in enumerate(outdirs):
        logs = {}
        for item in sorted(outdir.iterdir()):
            if item.name == "steps.txt":
                continue
            if item.is_dir():
                moves += [(f, folder / item.name / f.relative_to(item)) for f in sorted(item.rglob("*"))
                          if f.is_file()]
            elif item.name in TEST_LOGS:
                moves.append((item, root / "tests" / "logs" / f"{record}{TEST_LOGS[item.name]}.txt"))
            elif item.name == "conformance.txt":
                moves.append((item, root / "conformance" / "reports" / f"{record}_terminal.txt"))
            elif item.name.endswith(".tgz"):
                step = item.name[:-len(".tgz")]
                unpacked = staging / f"{n}_{step}"
                unpacked.mkdir()
                with tarfile.open(item) as archive:
                    archive.extractall(unpacked, filter="data")
                moves += [(f, archived_target(step, f.relative_to(unpacked), record, gpu, root))
                          for f in sorted(p for p in unpacked.rglob("*") if p.is_file())]
            else:
                moves.append((item, folder / item.name))
            if item.is_file() and item.suffix == ".txt":
                logs[item.stem] = command_of(item)
        if (outdir / "steps.txt").is_file():
            steps.append(f"# call {n + 1} ({outdir.name})")
            for line in (outdir / "steps.txt").read_text().splitlines():
                step = line.split(":")[0]
                command = logs.get(step.replace("-", "_"))
                if command:
                    steps.append(f"#   $ {command}")
                steps.append(line)
    return moves, "\n".join(steps) + "\n" if steps else ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", help="the commit the machine ran (names the record)")
    parser.add_argument("outdirs", nargs="+", type=Path, help="what cuda_record.sh handed back, one per call")
    parser.add_argument("--gpu", help="the record's GPU tag (default: read off the logs' headers)")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the tree to file into (default: this one)")
    args = parser.parse_args(argv)
    missing = [str(d) for d in args.outdirs if not d.is_dir()]
    if missing:
        raise SystemExit(f"file_record: no such folder: {', '.join(missing)}")
    gpu = args.gpu or gpu_tag(args.outdirs)
    if not gpu:
        raise SystemExit("file_record: no GPU name in the logs' headers: give --gpu")
    record = f"{gpu}_{args.tree}"
    with tempfile.TemporaryDirectory(prefix="file_record_") as staging:
        return file_sitting(args.outdirs, record, gpu, args.root, Path(staging))


def file_sitting(outdirs: list[Path], record: str, gpu: str, root: Path, staging: Path) -> int:
    """Copies the sitting's files into place (none where any would overwrite one); 0."""
    moves, steps = plan(outdirs, record, gpu, root, staging)
    steps_file = root / "bench" / "results" / record / "steps.txt"
    targets = [target for _, target in moves] + ([steps_file] if steps else [])
    taken = sorted({str(t) for t in targets if t.exists()} | {str(t) for t in targets if targets.count(t) > 1})
    if taken:
        raise SystemExit("file_record: would overwrite (nothing written): " + ", ".join(taken))
    for source, target in moves:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        print(f"{source.name} -> {target.relative_to(root)}")
    if steps:
        steps_file.parent.mkdir(parents=True, exist_ok=True)
        steps_file.write_text(steps)
        print(f"steps.txt -> {steps_file.relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
