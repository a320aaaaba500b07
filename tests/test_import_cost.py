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
import torch

PUBLIC_MODULES = ["kvlayout", "kvlayout.ops", "kvlayout.compat.lmcache", "kvlayout.compat.sglang", "kvlayout.dist"]

# In one fresh process: each public module imported in turn, then an engine worker's first calls on DEVICE
# (caches bound, a store and a retrieve, a prepared layer-wise store, a gather and a scatter, LMCache's
# drop-in); after each step, whether the process holds torch._dynamo (the first step that loads it is named).
_FIRST_STEPS = """
import importlib, sys, torch


def step(name):
    print(name, "torch._dynamo" in sys.modules, flush=True)


for module in {modules!r}:
    importlib.import_module(module)
    step("import " + module)

from kvlayout import ops
from kvlayout.compat import lmcache

device = {device!r}
L, NB, BS, H, D = 2, 8, 16, 4, 64
kv = [torch.randn(2, NB, BS, H, D, device=device).to(torch.bfloat16) for _ in range(L)]
slots = torch.tensor([17, 18, 19, 40, 41], device=device)
chunk = torch.zeros(2, L, 5, H * D, dtype=torch.bfloat16, device=device)
paged, chunked = ops.bind("vllm_flash_attn_nhd", kv), ops.bind("lmcache_kv_2ltd", chunk)
step("the first caches bound")
ops.transfer(paged, chunked, slots, None)
fresh = [torch.zeros_like(t) for t in kv]
ops.transfer(ops.bind("lmcache_kv_2ltd", chunk), ops.bind("vllm_flash_attn_nhd", fresh), None, slots)
step("a store and a retrieve")
prepared = ops.prepare(paged, chunked, slots, None)
for i in range(L):
    prepared.layer(i)
step("a prepared layer-wise store")
rows = ops.gather(paged, slots)
ops.scatter(ops.bind("vllm_flash_attn_nhd", fresh), rows, slots)
step("a gather and a scatter")
lmcache.multi_layer_kv_transfer(chunk, kv, slots, page_buffer_size=NB * BS, block_size=BS, head_size=D)
step("LMCache's drop-in")
if device == "cuda":
    torch.cuda.synchronize()
assert torch.equal(fresh[1][1, 40 // BS, 40 % BS], kv[1][1, 40 // BS, 40 % BS])
"""


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_importing_kvlayout_and_an_engines_first_calls_leave_the_compiler_unloaded(device):
    """Neither importing any public module nor the first cache bound and the first calls (where a status tensor
    is made and marked for the compiler) load torch._dynamo, whose import would cost a worker's start or its
    first call seconds."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    done = subprocess.run([sys.executable, "-c", _FIRST_STEPS.format(modules=PUBLIC_MODULES, device=device)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    steps = [line.rsplit(" ", 1) for line in done.stdout.splitlines()]
    assert len(steps) == len(PUBLIC_MODULES) + 5, done.stdout
    loaded = [name for name, holds in steps if holds == "True"]
    assert not loaded, f"{loaded[0]} loaded torch._dynamo"


# In a fresh process, kvlayout imported before or after torch._dynamo: the compiled program handle and a device's
# status tensor carry every attribute torch's own functions set (torch.compiler.assume_constant_result on a
# function; torch._dynamo.mark_static and mark_static_address on a tensor), with its value.
_MARKS = """
import sys
import torch
{first}
from kvlayout.ops import _native, programs

status = _native.status_tensor("cpu")     # (made and marked here, before or after dynamo is loaded)
assert ("torch._dynamo" in sys.modules) == {compiler_first}, "making the status tensor changed what is loaded"
import torch._dynamo


def new_marks(obj, mark) -> dict:
    before = dict(vars(obj))
    mark(obj)
    marks = {{name: value for name, value in vars(obj).items() if before.get(name, object()) is not value}}
    assert marks, f"{{mark}} set no attribute: see ops/compiler_marks.py"
    return marks


def reference():
    return 0


def static(t):
    torch._dynamo.mark_static(t)
    torch._dynamo.mark_static_address(t)


for ours, marks in ((programs.compiled_program_handle, new_marks(reference, torch.compiler.assume_constant_result)),
                    (status, new_marks(torch.zeros_like(status), static))):
    wrong = {{name for name, value in marks.items() if getattr(ours, name, None) != value}}
    assert not wrong, f"{{ours!r}} lacks {{wrong}}"
print("marked")
"""


@pytest.mark.parametrize("compiler_first", [False, True], ids=["kvlayout-first", "compiler-first"])
def test_kvlayouts_objects_carry_the_marks_torch_sets(compiler_first):
    code = _MARKS.format(first="import torch._dynamo" if compiler_first else "", compiler_first=compiler_first)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "marked"
