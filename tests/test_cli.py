"""The command line: the catalog listing and the generated spec (kept in sync with docs/spec.md)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

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
