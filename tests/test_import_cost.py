"""What importing kvlayout costs a process: no more of torch than the process asked for.

torch loads ``torch._dynamo`` (the compiler's front end, about as long to import as torch itself) only when
something touches it. An engine's worker, a test's child process or a command-line run that imports kvlayout
and never compiles must not pay for it; a process that compiles loads it anyway, and kvlayout's compiled calls
must then look to dynamo exactly as they would had kvlayout imported it itself.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

PUBLIC_MODULES = ["kvlayout", "kvlayout.ops", "kvlayout.compat.lmcache", "kvlayout.compat.sglang", "kvlayout.dist"]


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_importing_kvlayout_leaves_the_compiler_unloaded(module):
    code = (f"import sys, importlib, torch; importlib.import_module({module!r}); "
            "print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", f"importing {module} loaded torch._dynamo"


# In a fresh process, kvlayout imported before or after torch._dynamo: compiled_program_handle carries every
# attribute torch.compiler.assume_constant_result sets on a function, with its value.
_MARKS = """
import torch
{first}
from kvlayout.ops import programs

def reference():
    return 0

before = dict(vars(reference))
torch.compiler.assume_constant_result(reference)
marks = {{name: value for name, value in vars(reference).items() if before.get(name, object()) is not value}}
assert marks, "torch.compiler.assume_constant_result set no attribute: see ops/programs.py"
wrong = {{name for name, value in marks.items() if getattr(programs.compiled_program_handle, name, None) != value}}
assert not wrong, f"compiled_program_handle lacks {{wrong}}"
print("marked")
"""


@pytest.mark.parametrize("first", ["", "import torch._dynamo"], ids=["kvlayout-first", "compiler-first"])
def test_the_compiled_program_handle_carries_the_mark_torch_sets(first):
    done = subprocess.run([sys.executable, "-c", _MARKS.format(first=first)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "marked"
