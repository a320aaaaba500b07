"""The command line: the catalog listing, the generated spec (kept in sync with docs/spec.md), where outputs go,
and usage errors (one line on standard error, exit status 2, never a traceback)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import pytest

from kvlayout import reference as R
from kvlayout.cli import COMMANDS, main

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_layouts_json_lists_the_catalog(capsys):
    assert main(["layouts", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in records] == list(R.CATALOG)
    assert all({"family", "planes", "structure", "origin", "patterns"} <= set(r) for r in records)


def test_layouts_table(capsys):
    assert main(["layouts"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["name", "family", "planes", "structure", "origin"]
    for name in R.CATALOG:
        assert f"\n{name} " in out


def test_spec_matches_committed_doc(capsys):
    assert main(["spec"]) == 0
    generated = capsys.readouterr().out
    committed = (ROOT / "docs" / "spec.md").read_text(encoding="utf-8")
    assert generated == committed, "docs/spec.md is stale: run `kvlayout spec --out docs/spec.md`"
    for name in R.CATALOG:
        assert f"### `{name}`" in generated
    for op in ("transfer", "gather", "scatter", "skip_prefix", "move", "get_page", "set_page", "zero_page",
               "page_spans", "rope_reposition"):
        assert f"#### `{op}`" in generated


def test_spec_out_file(tmp_path):
    out = tmp_path / "spec.md"
    assert main(["spec", "--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8").startswith("# kvlayout specification")


def test_python_m_kvlayout_layouts_does_not_import_torch(tmp_path):
    code = ("import sys; from kvlayout.cli import main; main(['layouts']); "
            "assert 'torch' not in sys.modules and 'jax' not in sys.modules, 'heavy import'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(tmp_path), capture_output=True)
    done = subprocess.run([sys.executable, "-m", "kvlayout", "layouts"], check=True, cwd=str(tmp_path),
                          capture_output=True, text=True)
    assert "vllm_flash_attn_nhd" in done.stdout


def test_every_command_module_has_the_interface():
    import importlib

    for name, (module, help_text) in COMMANDS.items():
        mod = importlib.import_module(module)
        assert callable(mod.add_arguments) and callable(mod.run) and help_text, name


def test_spec_check_exit_status(tmp_path, capsys):
    fresh, stale = tmp_path / "fresh.md", tmp_path / "stale.md"
    assert main(["spec", "--out", str(fresh)]) == 0
    stale.write_text(fresh.read_text(encoding="utf-8").replace("slot_out_of_range", "slot_oob"), encoding="utf-8")
    assert main(["spec", "--check", str(fresh)]) == 0
    assert main(["spec", "--check", str(stale)]) == 1
    assert "is stale" in capsys.readouterr().err
    assert main(["spec", "--check", str(tmp_path / "missing.md")]) == 1


def test_spec_renders_every_rule(capsys):
    assert main(["spec"]) == 0
    text = capsys.readouterr().out
    for rule in R.RULES.values():
        line = f"* **`{rule.name}`**: {rule.statement}"
        assert line in text, rule.name
        if rule.error is not None:
            assert f"Raises `{rule.error.__name__}`" in text.split(line, 1)[1].splitlines()[0], rule.name


# ---------------------------------------------------------------------------------------
# Usage errors: one line, exit status 2
# ---------------------------------------------------------------------------------------

def _usage_error(capsys, argv: list[str]) -> str:
    """Run ``kvlayout ARGV``; assert a one-line usage error with status 2 and return the line."""
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"kvlayout {argv[0]}: "), lines[0]
    return lines[0]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in sys.path if p]))


def test_mistyped_layout_name_suggests_the_closest():
    import torch

    from kvlayout import ops

    kv = [torch.zeros(2, 4, 16, 2, 8)]
    with pytest.raises(KeyError, match=r"unknown layout 'vllm_flash_atn_nhd'; did you mean 'vllm_flash_attn_nhd'"):
        ops.bind("vllm_flash_atn_nhd", kv)
    with pytest.raises(KeyError) as info:           # nothing close: no guess, the catalog
        R.get("zzz")
    assert "did you mean" not in str(info.value) and "vllm_flash_attn_nhd" in str(info.value)


def test_layouts_json_into_a_closed_pipe_ends_quietly():
    """``kvlayout layouts --json | head``: the reader is gone before the first write; no BrokenPipeError."""
    read_end, write_end = os.pipe()
    os.close(read_end)                               # every write now fails with EPIPE
    proc = subprocess.run([sys.executable, "-m", "kvlayout", "layouts", "--json"], stdout=write_end,
                          stderr=subprocess.PIPE, text=True, cwd=str(ROOT), env=_env(), timeout=120)
    os.close(write_end)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.returncode == 141


def _help(capsys, command: str) -> str:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    return " ".join(capsys.readouterr().out.split())   # argparse wraps lines: compare on single spaces


def _option_help(text: str, option: str) -> str:
    """The help text of ``option`` in a flattened ``--help`` output (up to the next option)."""
    options = re.split(r"options:|optional arguments:", text, maxsplit=1)[1]
    metavar, alias = r"(?: [A-Z_]+)?", r"(?:, --[a-z-]+(?: [A-Z_]+)?)?"
    match = re.search(r"(?:^| )" + re.escape(option) + metavar + alias + r" (.*?)(?= --[a-z]|$)", options)
    assert match, option
    return match.group(1)


def test_help_explains_seed_and_states_out_defaults(capsys):
    from kvlayout.conformance import runner

    bench = _help(capsys, "bench")
    assert "seed" in _option_help(bench, "--seed") and "default 0" in _option_help(bench, "--seed")
    assert "default: results/bench" in _option_help(bench, "--out")
    conformance = _help(capsys, "conformance")
    assert "(default 0)" in _option_help(conformance, "--seed")
    assert "default: results/conformance" in _option_help(conformance, "--out")
    assert runner.SANITIZE_SCOPE in conformance          # --sanitize's scope, in the words of the report
    assert "standard output" in _option_help(_help(capsys, "spec"), "--out")


def test_sanitize_scope_is_stated_once():
    """The help, the report and the docs say what ``--sanitize`` runs in one wording, naming every family."""
    from kvlayout.conformance import report, runner

    for family in runner.SANITIZE_FAMILIES.split(","):
        assert family in runner.SANITIZE_SCOPE
    data = {"name": "cpu", "summary": {"status": "PASS", "cases": 0, "passed": 0, "failed": 0}, "seconds": 0,
            "date": "-", "command": "kvlayout conformance", "settings": {"examples": 1, "seed": 0, "families": []},
            "devices": [], "environment": {}, "rules": {}, "families": {}, "per_family": [], "results": [],
            "failures": [], "sanitizer": None}
    assert f"`--sanitize` {runner.SANITIZE_SCOPE}" in report.markdown(data)
    docs = " ".join((ROOT / "docs" / "conformance.md").read_text(encoding="utf-8").split())
    assert runner.SANITIZE_SCOPE in docs


def test_spec_check_says_when_the_doc_is_up_to_date(tmp_path, capsys):
    fresh = tmp_path / "fresh.md"
    assert main(["spec", "--out", str(fresh)]) == 0
    capsys.readouterr()
    assert main(["spec", "--check", str(fresh)]) == 0
    assert capsys.readouterr().out.strip() == f"kvlayout spec --check: {fresh} is up to date"


def test_spec_has_no_raw_sphinx_roles():
    text = (ROOT / "docs" / "spec.md").read_text(encoding="utf-8")
    roles = re.findall(r":(?:func|class|mod|data|meth|attr|obj|exc):`[^`]*`", text)
    assert not roles, roles
    # skip_prefix counts positions: the first n entries go, whatever their slot values
    section = text.split("#### `skip_prefix`", 1)[1].split("####", 1)[0]
    assert "positions ``0..n-1``" in section and "entries ``< n``" not in section


def test_spec_out_that_cannot_be_written_is_a_usage_error(tmp_path, capsys):
    line = _usage_error(capsys, ["spec", "--out", str(tmp_path / "missing" / "spec.md")])
    assert "--out" in line and "does not exist" in line
    line = _usage_error(capsys, ["spec", "--out", str(tmp_path)])
    assert "is a folder" in line


def test_replay_refuses_what_no_sample_repr_contains_at_once(capsys):
    """Arithmetic is refused before anything is evaluated (``9**9**9`` would run for hours, ``'a'*10**11`` would
    ask for 100 GB); an empty text is a usage error, not the whole suite."""
    started = time.monotonic()
    for text in ("9**9**9", "'a'*10**11", "[x for x in range(10**12)]", "__import__('os').system('true')",
                 "TransferSample(case=-(1,))", "TransferSample(", "Geometry(P=1, L=1, NB=1, BS=1, H=1, E=1)"):
        line = _usage_error(capsys, ["conformance", "--replay", text])
        assert "--replay is not a sample's repr" in line, line
    assert time.monotonic() - started < 60
    for text in ("", "   "):
        line = _usage_error(capsys, ["conformance", "--replay", text])
        assert "--replay needs the repr of a sample" in line


def test_replay_of_hostile_text_in_a_process_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvlayout", "conformance", "--replay", "'a'*10**11"],
                          capture_output=True, text=True, cwd=str(tmp_path), env=_env(), timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr


def test_conformance_usage_errors(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    line = _usage_error(capsys, ["conformance", "--only", "move", "--out", str(a_file / "reports")])
    assert "--out" in line and "cannot create the folder" in line
    assert "matches no family" in _usage_error(capsys, ["conformance", "--only", "nothing"])
    assert "unknown device kind 'gpu'" in _usage_error(capsys, ["conformance", "--device", "gpu"])
    assert "names no device" in _usage_error(capsys, ["conformance", "--device", ","])
    assert "--examples must be >= 1" in _usage_error(capsys, ["conformance", "--examples", "0"])
    assert "unrecognized arguments" in _usage_error(capsys, ["conformance", "--no-such-option"])


def test_bench_usage_errors_before_measuring(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    line = _usage_error(capsys, ["bench", "--device", "cpu", "--out", str(a_file / "bench")])
    assert "--out" in line and "cannot create the folder" in line
    previous = tmp_path / "previous"
    previous.mkdir()
    (previous / "cpu.jsonl").write_text("kept\n")
    line = _usage_error(capsys, ["bench", "--device", "cpu", "--only", "no such case", "--out", str(previous)])
    assert "selects none of the" in line
    assert (previous / "cpu.jsonl").read_text() == "kept\n"       # the previous results are left alone
    assert "is not a device" in _usage_error(capsys, ["bench", "--device", "gpu0"])


# ---------------------------------------------------------------------------------------
# Default outputs: one git-ignored folder
# ---------------------------------------------------------------------------------------

def test_default_outputs_go_to_the_ignored_results_folder(tmp_path, monkeypatch, capsys):
    from kvlayout.cli import _parser

    assert _parser("bench").parse_args(["bench"]).out == "results/bench"
    assert _parser("conformance").parse_args(["conformance"]).out == os.path.join("results", "conformance")
    monkeypatch.chdir(tmp_path)
    assert main(["conformance", "--only", "move", "--examples", "1", "--jobs", "1", "--no-progress"]) == 0
    assert sorted(os.listdir(tmp_path / "results" / "conformance")) == ["cpu.json", "cpu.md"]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_results_folder_is_ignored_and_records_are_not():
    def ignored(path: str) -> bool:
        return subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", path]).returncode == 0

    assert ignored("results/conformance/cpu.md") and ignored("results/bench/cpu.jsonl")
    assert not ignored("conformance/reports/cpu.md") and not ignored("bench/results/cpu.jsonl")
