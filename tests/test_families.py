"""The case database on every device: the samples, references and error inputs ``kvlayout conformance`` runs.

Device-generic: each test takes the ``device`` fixture (``cpu``, and
``cuda`` where present).  The default run draws a few samples per family
(:data:`EXAMPLES`, and the counts in each test; new ones each run, under the
suite's hypothesis profile); ``KVLAYOUT_HYPOTHESIS_EXAMPLES=k`` multiplies
them, and the tests marked ``slow`` draw more of them.  Long runs
belong to ``kvlayout conformance --examples N`` (the same samples).  A
failing example prints its sample; ``kvlayout conformance --device D
--replay '<sample>'`` runs it again.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from kvlayout.conformance import strategies as S
from kvlayout.conformance.families import FAMILIES, errors, hostile, pages, rope, rows, transfer

import torch_cases as TC

EXAMPLES = {"prepared": 12, "staged": 8, "gather": 10, "scatter": 10, "move": 8, "rope": 12, "fuzz_index": 8}
"""Samples per device in the default run, for the families drawn as a whole."""

LAYOUTS = S.layout_names(include_rows=True)


def run_samples(strategy, device: str, examples: int) -> None:
    """Draw ``examples`` samples of ``strategy`` and run each on ``device`` (hypothesis shrinks a failure)."""
    @settings(max_examples=TC.examples(examples))
    @given(sample=strategy)
    def check(sample):
        sample.run(device)

    check()


# ---------------------------------------------------------------------------------------
# transfer: every layout as source and as destination, every dtype
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_transfer_from_every_layout(device, layout):
    run_samples(transfer.transfer_samples(device, pairs=[p for p in transfer.layout_pairs() if p[0] == layout]),
                device, 2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_transfer_into_every_layout(device, layout):
    run_samples(transfer.transfer_samples(device, pairs=[p for p in transfer.layout_pairs() if p[1] == layout]),
                device, 2)


@pytest.mark.parametrize("dtype", S.DTYPES)
def test_transfer_every_dtype(device, dtype):
    run_samples(transfer.transfer_samples(device, dtype=dtype), device, 1)


@pytest.mark.slow
def test_transfer_more_samples(device):
    run_samples(FAMILIES["transfer"].strategy(device), device, 24)


# ---------------------------------------------------------------------------------------
# the families drawn as a whole
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(EXAMPLES))
def test_family(device, family):
    run_samples(FAMILIES[family].strategy(device), device, EXAMPLES[family])


@pytest.mark.slow
@pytest.mark.parametrize("family", list(EXAMPLES))
def test_family_more_samples(device, family):
    run_samples(FAMILIES[family].strategy(device), device, 2 * EXAMPLES[family])


# Two per layout: the reference's page helpers run eagerly (a page's element masks come from concrete
# values), so a page sample costs more than a copy; the NaN-payload and compile tests call these ops again.
@pytest.mark.parametrize("layout", S.layout_names("host") + ("vllm_flash_attn_hnd", "vllm_cross_layer", "sglang_mha"))
@pytest.mark.parametrize("op", pages.PAGE_OPS)
def test_page_helpers(device, layout, op):
    run_samples(pages.page_samples(device, layout=layout, op=op), device, 1)


@pytest.mark.parametrize("group", ["neox", "gptj", "neox packed", "gptj packed"])
def test_rope_pairings(device, group):
    run_samples(rope.rope_samples(device, group), device, 3)


# ---------------------------------------------------------------------------------------
# error inputs and hostile inputs: every kind, on every device it applies to
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(errors.ERROR_KINDS))
def test_error_input(device, kind):
    if kind not in errors.error_kinds(device):
        pytest.skip(f"{kind} needs another device")
    run_samples(errors.bad_input_samples(device, kind), device, 2)


def test_every_error_kind_cites_a_rule_with_an_exception():
    for kind in errors.ERROR_KINDS.values():
        assert issubclass(kind.error_type, Exception), kind.name
        assert kind.error_regex, kind.name


@pytest.mark.parametrize("kind", hostile.HOSTILE_KINDS)
def test_hostile_input(device, kind):
    if kind not in hostile.hostile_kinds(device):
        pytest.skip(f"{kind} runs on the CPU only")
    run_samples(hostile.hostile_samples(device, kind), device, 1)


def test_every_family_is_consumed_here():
    covered = set(EXAMPLES) | {"transfer", "pages", "bad_input", "hostile"}
    assert covered == set(FAMILIES), set(FAMILIES) ^ covered
    assert {rows.GATHER.name, rows.SCATTER.name, rows.MOVE.name} <= covered
