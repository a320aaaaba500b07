"""Tests of kvlayout's raw native ops (torch.ops.kvlayout.copy_rows / rope_reposition).

The oracle for copy_rows is a numpy byte copy through real strided views:
each side is a uint8 view [num_blocks, page, pieces, piece_bytes] of a
buffer whose dimensions are laid out in some permuted order (with padding),
and the expected result assigns view[d // page, d % page] = view[s // page,
s % page] with numpy indexing. The whole destination buffer, padding
included, is compared byte for byte.
"""

import numpy as np
import pytest
import torch

from kvlayout.conformance.families.rope import assert_rope, cos_sin_table, expected_keys
from kvlayout.ops import _native as nat

DEVICES = ["cpu"] + (["cuda"] if nat.cuda_available() else [])
# torch.compile of the raw ops on CPU (inductor's C++ build) is slow, and test_ops_compile
# already compiles every public op on CPU: the CPU variants here run in the full suite only.
COMPILE_DEVICES = [pytest.param(d, marks=pytest.mark.slow) if d == "cpu" else d for d in DEVICES]
needs_cuda = pytest.mark.skipif(not nat.cuda_available(), reason="CUDA kernels not built or no GPU")


# ----------------------------------------------------------------------------- helpers


class Side:
    """One side of a copy: `layers` segments, each a strided uint8 view
    [nb, page, pieces, piece_bytes], held either in one buffer (cross-layer)
    or one buffer per layer."""

    def __init__(self, rng, layers, nb, page, pieces, piece_bytes, order, pad, lead,
                 one_tensor, num_slots=None):
        self.layers, self.nb, self.page, self.pieces, self.pb = layers, nb, page, pieces, piece_bytes
        self.num_slots = nb * page if num_slots is None else num_slots
        sizes = [nb, page, pieces]
        phys = [sizes[i] for i in order] + [piece_bytes + pad]
        per_layer = int(np.prod(phys))
        inv = list(np.argsort(order)) + [3]
        if one_tensor:
            raw = torch.from_numpy(rng.integers(0, 256, lead + layers * per_layer, dtype=np.uint8))
            self.tensors = [raw]
            self.segments = []
            for l in range(layers):
                self.segments += [0, lead + l * per_layer]
        else:
            self.tensors = [torch.from_numpy(rng.integers(0, 256, lead + per_layer, dtype=np.uint8))
                            for _ in range(layers)]
            self.segments = []
            for l in range(layers):
                self.segments += [l, lead]
        self.order, self.phys, self.inv, self.per_layer, self.lead = order, phys, inv, per_layer, lead
        v = self.view_np(self.tensors, 0)
        st = v.strides
        self.geometry = [self.num_slots, page, st[0], st[1], st[2]]

    def view_np(self, tensors, layer):
        ti, off = self.segments[2 * layer], self.segments[2 * layer + 1]
        a = tensors[ti].numpy()
        flat = a[off: off + self.per_layer].reshape(self.phys)
        return flat.transpose(self.inv)[..., : self.pb]

    def to(self, device, pin=False):
        if pin:
            self.tensors = [t.pin_memory() for t in self.tensors]
        elif device != "cpu":
            self.tensors = [t.to(device) for t in self.tensors]
        return self

    def host_copy(self):
        return [t.cpu().clone() for t in self.tensors]


def oracle(src_host, src, dst_host, dst, src_slots, dst_slots, num_tokens, skip_prefix):
    out = [t.clone() for t in dst_host]
    for t in range(skip_prefix, num_tokens):
        s = t if src_slots is None else int(src_slots[t])
        d = t if dst_slots is None else int(dst_slots[t])
        if s < 0 or d < 0:
            continue
        for l in range(src.layers):
            sv = src.view_np(src_host, l)
            dv = dst.view_np(out, l)
            dv[d // dst.page, d % dst.page] = sv[s // src.page, s % src.page]
    return out


def run_copy(src, dst, src_slots, dst_slots, num_tokens, skip_prefix=0, max_ctas=0, status=None):
    nat.copy_rows(src.tensors, dst.tensors, src_slots, dst_slots, num_tokens, skip_prefix,
                  src.segments, dst.segments, src.geometry, dst.geometry, src.pieces, src.pb,
                  max_ctas, status)


def slot_tensor(values, dtype, device):
    if values is None:
        return None
    return torch.tensor(values, dtype=dtype, device=device)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()
        nat.raise_on_device_errors(device)


# A spread of geometries: vector widths 1..16 bytes, pieces, paging, permuted
# (HND-like) orders, padding, unaligned segment offsets, cross-layer buffers.
CASES = [
    # layers, nb, page, pieces, piece_bytes, src_order, dst_order, pad, lead, one_tensor
    (2, 4, 16, 1, 128, (0, 1, 2), (0, 1, 2), 0, 0, False),  # NHD rows, 16-byte vectors
    (3, 6, 8, 4, 64, (0, 2, 1), (0, 1, 2), 0, 0, True),     # HND -> NHD, pieces = heads
    (2, 5, 4, 2, 24, (1, 0, 2), (2, 0, 1), 8, 16, False),   # 8-byte vectors
    (1, 3, 7, 3, 12, (0, 1, 2), (2, 1, 0), 4, 4, True),     # 4-byte vectors, odd page
    (2, 4, 5, 2, 6, (0, 1, 2), (0, 2, 1), 2, 2, False),     # 2-byte vectors
    (2, 3, 3, 3, 5, (2, 0, 1), (0, 1, 2), 1, 1, True),      # 1-byte vectors
    (1, 2, 1, 1, 4096, (0, 1, 2), (0, 1, 2), 0, 0, False),  # page 1, 4 KiB rows
    (4, 2, 32, 8, 16, (0, 1, 2), (0, 1, 2), 16, 0, True),   # strided pieces
    (2, 8, 256, 1, 32, (0, 1, 2), (0, 1, 2), 0, 0, False),  # large pages
]


def random_slots(rng, n, num_slots, neg_frac=0.1, unique=True):
    if unique:
        vals = rng.permutation(num_slots)[:n]
    else:
        vals = rng.integers(0, num_slots, n)
    vals = vals.astype(np.int64)
    vals[rng.random(n) < neg_frac] = -1
    return vals.tolist()


# ----------------------------------------------------------------------------- copy_rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("slot_dtypes", [(torch.int64, torch.int64), (torch.int32, torch.int32),
                                         (torch.int32, torch.int64)])
def test_copy_rows_matches_oracle(device, case, slot_dtypes):
    layers, nb, page, pieces, pb, so, do, pad, lead, one = CASES[case]
    rng = np.random.default_rng(case * 7 + 1)
    src = Side(rng, layers, nb, page, pieces, pb, so, pad, lead, one)
    dst = Side(rng, layers, nb + 1, page, pieces, pb, do, pad + 1 if pad else 0, lead, not one)
    if pb == 4096 or (pad == 0 and lead == 0):
        dst = Side(rng, layers, nb + 1, page, pieces, pb, do, pad, lead, not one)
    n = min(src.num_slots, dst.num_slots) - 1
    ss = random_slots(rng, n, src.num_slots, unique=False)
    ds = random_slots(rng, n, dst.num_slots)
    src_host, dst_host = src.host_copy(), dst.host_copy()
    expected = oracle(src_host, src, dst_host, dst, ss, ds, n, 0)
    src.to(device), dst.to(device)
    run_copy(src, dst, slot_tensor(ss, slot_dtypes[0], device),
             slot_tensor(ds, slot_dtypes[1], device), n)
    sync(device)
    for got, want in zip(dst.tensors, expected):
        assert torch.equal(got.cpu(), want)
    for got, want in zip(src.tensors, src_host):
        assert torch.equal(got.cpu(), want)  # source untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("identity", ["src", "dst", "both"])
def test_copy_rows_identity_slots_and_runs(device, identity):
    rng = np.random.default_rng(3)
    # Page-contiguous on both sides: identity slots form one long run.
    src = Side(rng, 2, 4, 8, 1, 64, (0, 1, 2), 0, 0, False)
    dst = Side(rng, 2, 4, 8, 1, 64, (0, 1, 2), 0, 0, True)
    n = 29
    ss = None if identity in ("src", "both") else list(range(3, 3 + n))
    ds = None if identity in ("dst", "both") else list(range(n))[::-1]
    expected = oracle(src.host_copy(), src, dst.host_copy(), dst, ss, ds, n, 0)
    src.to(device), dst.to(device)
    run_copy(src, dst, slot_tensor(ss, torch.int64, device), slot_tensor(ds, torch.int32, device), n)
    sync(device)
    for got, want in zip(dst.tensors, expected):
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_copy_rows_skip_prefix_and_negative_slots(device):
    rng = np.random.default_rng(5)
    src = Side(rng, 2, 4, 4, 2, 32, (0, 1, 2), 0, 0, True)
    dst = Side(rng, 2, 4, 4, 2, 32, (1, 0, 2), 0, 0, False)
    n = 12
    ss = list(range(n))
    ds = [5, 6, -1, 7, 8, -3, 9, 10, 0, -1, 1, 2]
    for skip in (0, 3, 12):
        dst_host = dst.host_copy()
        expected = oracle(src.host_copy(), src, dst_host, dst, ss, ds, n, skip)
        s2 = Side.__new__(Side)
        s2.__dict__.update(src.__dict__)
        d2 = Side.__new__(Side)
        d2.__dict__.update(dst.__dict__)
        s2.to(device), d2.to(device)
        run_copy(s2, d2, slot_tensor(ss, torch.int64, device), slot_tensor(ds, torch.int64, device),
                 n, skip_prefix=skip)
        sync(device)
        for got, want in zip(d2.tensors, expected):
            assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_copy_rows_empty_is_noop(device):
    rng = np.random.default_rng(0)
    src = Side(rng, 1, 2, 4, 1, 16, (0, 1, 2), 0, 0, True).to(device)
    dst = Side(rng, 1, 2, 4, 1, 16, (0, 1, 2), 0, 0, True).to(device)
    before = dst.host_copy()
    run_copy(src, dst, slot_tensor([], torch.int64, device), slot_tensor([], torch.int64, device), 0)
    nat.copy_rows(src.tensors, dst.tensors, None, None, 4, 0, [], [], src.geometry, dst.geometry, 1, 16)
    sync(device)
    assert torch.equal(dst.tensors[0].cpu(), before[0])


def test_copy_rows_out_of_range_raises_before_writing_cpu():
    rng = np.random.default_rng(1)
    src = Side(rng, 2, 4, 4, 1, 16, (0, 1, 2), 0, 0, True)
    dst = Side(rng, 2, 4, 4, 1, 16, (0, 1, 2), 0, 0, True)
    before = dst.host_copy()
    ds = torch.tensor([0, 1, 2, 3, 4, 5, 6, 1000, 8])
    with pytest.raises(IndexError, match=r"dst_slots\[7\] = 1000 is out of range: the destination holds 16 slots"):
        run_copy(src, dst, None, ds, 9)
    assert torch.equal(dst.tensors[0], before[0])
    with pytest.raises(IndexError, match=r"src_slots\[1\] = 16 is out of range: the source holds 16 slots"):
        run_copy(src, dst, torch.tensor([0, 16], dtype=torch.int32), None, 2)
    with pytest.raises(IndexError, match=r"src_slots is None, so token 16 uses slot 16"):
        big = Side(rng, 2, 5, 4, 1, 16, (0, 1, 2), 0, 0, True)
        run_copy(src, big, None, None, 17)
    assert torch.equal(dst.tensors[0], before[0])


@pytest.mark.parametrize("device", DEVICES)
def test_copy_rows_argument_errors(device):
    rng = np.random.default_rng(2)
    src = Side(rng, 2, 4, 4, 1, 16, (0, 1, 2), 0, 0, True).to(device)
    dst = Side(rng, 2, 4, 4, 1, 16, (0, 1, 2), 0, 0, False).to(device)
    slots = torch.arange(4, device=device)
    S, D, sg, dg = src.tensors, dst.tensors, src.segments, dst.segments

    def call(**kw):
        args = dict(src=S, dst=D, src_slots=slots, dst_slots=slots, num_tokens=4, skip_prefix=0,
                    src_segments=sg, dst_segments=dg, src_geometry=src.geometry,
                    dst_geometry=dst.geometry, num_pieces=1, piece_bytes=16)
        args.update(kw)
        nat.copy_rows(**args)

    with pytest.raises(ValueError, match="skip_prefix"):
        call(skip_prefix=5)
    with pytest.raises(RuntimeError, match="piece_bytes"):
        call(piece_bytes=0)
    with pytest.raises(RuntimeError, match="num_pieces"):
        call(num_pieces=0)
    with pytest.raises(RuntimeError, match="same number of segments"):
        call(dst_segments=dg[:2])
    with pytest.raises(RuntimeError, match=r"src_segments\[2\] = 3 is not a valid index"):
        call(src_segments=[0, 0, 3, 0])
    with pytest.raises(ValueError, match="src_slots has 3 entries"):
        call(src_slots=slots[:3])
    with pytest.raises(TypeError, match="int32 or int64"):
        call(src_slots=slots.float())
    with pytest.raises(RuntimeError, match="page_size"):
        call(src_geometry=[16, 0, 64, 16, 16])
    # Storage bounds: an offset or a slot count that reaches past the storage.
    with pytest.raises(RuntimeError, match="holds only"):
        call(src_segments=[0, 0, 0, sg[3] + 1])
    with pytest.raises(RuntimeError, match="holds only"):
        call(dst_geometry=[17] + dst.geometry[1:])
    with pytest.raises(RuntimeError, match="holds only"):
        call(src_geometry=src.geometry[:4] + [16], num_pieces=2, piece_bytes=16)
    with pytest.raises(RuntimeError, match="holds only"):
        # A view into the middle of a storage: bounds are the storage's, from the view's start.
        call(src=[S[0][S[0].numel() // 2:]])
    with pytest.raises(RuntimeError, match="overflows"):
        call(src_geometry=[16, 4, 2**62, 16, 16])


@pytest.mark.parametrize("device", DEVICES)
def test_copy_rows_many_segments(device):
    # More segments than one CUDA launch takes (128): the launcher splits.
    rng = np.random.default_rng(9)
    src = Side(rng, 130, 2, 4, 1, 16, (0, 1, 2), 0, 0, True)
    dst = Side(rng, 130, 2, 4, 1, 16, (1, 0, 2), 0, 0, True)
    ss, ds = [7, 0, 3, 5], [1, 2, 6, -1]
    expected = oracle(src.host_copy(), src, dst.host_copy(), dst, ss, ds, 4, 0)
    src.to(device), dst.to(device)
    run_copy(src, dst, slot_tensor(ss, torch.int64, device), slot_tensor(ds, torch.int64, device), 4)
    sync(device)
    assert torch.equal(dst.tensors[0].cpu(), expected[0])


@pytest.mark.parametrize("device", DEVICES)
def test_copy_rows_opcheck(device):
    rng = np.random.default_rng(4)
    src = Side(rng, 2, 3, 4, 2, 16, (0, 2, 1), 0, 0, True).to(device)
    dst = Side(rng, 2, 3, 4, 2, 16, (0, 1, 2), 0, 0, False).to(device)
    ss = torch.tensor([0, 5, -1, 11], device=device)
    ds = torch.tensor([3, 2, 1, 0], device=device, dtype=torch.int32)
    args = (src.tensors, dst.tensors, ss, ds, 4, 1, src.segments, dst.segments, src.geometry,
            dst.geometry, 2, 16, 0, nat.status_tensor(device))
    torch.library.opcheck(torch.ops.kvlayout.copy_rows.default, args)


@pytest.mark.parametrize("device", COMPILE_DEVICES)
def test_copy_rows_compile_fullgraph(device):
    rng = np.random.default_rng(6)
    src = Side(rng, 2, 3, 4, 1, 32, (0, 1, 2), 0, 0, True)
    dst = Side(rng, 2, 3, 4, 1, 32, (0, 1, 2), 0, 0, True)
    ss = slot_tensor([1, 4, 7, -1, 9], torch.int64, device)
    ds = slot_tensor([0, 3, 2, 5, 11], torch.int64, device)
    d_eager = [t.clone().to(device) for t in dst.tensors]
    d_comp = [t.clone().to(device) for t in dst.tensors]
    s_dev = [t.to(device) for t in src.tensors]

    def f(s, d, a, b):
        nat.copy_rows(s, d, a, b, 5, 0, src.segments, dst.segments, src.geometry, dst.geometry, 1, 32)
        return d[0].sum(dtype=torch.int64)

    r_eager = f(s_dev, d_eager, ss, ds)
    torch._dynamo.reset()
    # On the CPU the graph is traced and functionalized (where an op's schema meets torch.compile) but not
    # lowered by inductor, whose C++ build of the sum would take most of a minute; the ops-level compile
    # tests (test_ops_compile.py) run inductor on the CPU, and this test runs it on CUDA.
    backend = "aot_eager" if device == "cpu" else "inductor"
    r_comp = torch.compile(f, fullgraph=True, backend=backend)(s_dev, d_comp, ss, ds)
    sync(device)
    assert torch.equal(d_eager[0].cpu(), d_comp[0].cpu())
    assert int(r_eager) == int(r_comp)


# ----------------------------------------------------------------------------- CUDA specifics


@needs_cuda
@pytest.mark.parametrize("placement", ["h2d", "d2h", "h2h"])
def test_copy_rows_pinned_host(placement):
    rng = np.random.default_rng(11)
    src = Side(rng, 2, 4, 8, 2, 64, (0, 2, 1), 0, 0, True)
    dst = Side(rng, 2, 4, 8, 2, 64, (0, 1, 2), 0, 0, False)
    ss = random_slots(rng, 20, 32)
    ds = random_slots(rng, 20, 32)
    expected = oracle(src.host_copy(), src, dst.host_copy(), dst, ss, ds, 20, 0)
    src.to("cuda", pin=placement in ("h2d", "h2h"))
    dst.to("cuda", pin=placement in ("d2h", "h2h"))
    slots_dev = "cpu" if placement == "h2h" else "cuda"
    a, b = slot_tensor(ss, torch.int64, slots_dev), slot_tensor(ds, torch.int64, slots_dev)
    if placement == "h2h":
        a, b = a.pin_memory(), b.pin_memory()
    run_copy(src, dst, a, b, 20, status=nat.status_tensor("cuda"))
    sync("cuda")
    for got, want in zip(dst.tensors, expected):
        assert torch.equal(got.cpu(), want)


@needs_cuda
def test_copy_rows_unpinned_host_rejected():
    rng = np.random.default_rng(12)
    src = Side(rng, 1, 2, 4, 1, 16, (0, 1, 2), 0, 0, True)
    dst = Side(rng, 1, 2, 4, 1, 16, (0, 1, 2), 0, 0, True).to("cuda")
    with pytest.raises(ValueError, match=r"src\[0\] is an unpinned host tensor: pin it with .pin_memory\(\)"):
        run_copy(src, dst, None, None, 4)


@needs_cuda
def test_copy_rows_status_records_out_of_range():
    rng = np.random.default_rng(13)
    src = Side(rng, 2, 2, 4, 1, 16, (0, 1, 2), 0, 0, True).to("cuda")
    dst = Side(rng, 2, 2, 4, 1, 16, (0, 1, 2), 0, 0, True).to("cuda")
    before = dst.host_copy()
    ss = torch.tensor([0, 1, 2, 3], device="cuda")
    ds = torch.tensor([-1, 4000, 7, 9], device="cuda")
    expected = oracle(src.host_copy(), src, before, dst, [0, 1, 2, 3], [-1, -1, 7, -1], 4, 0)
    run_copy(src, dst, ss, ds, 4)
    torch.cuda.synchronize()
    st = nat.status_tensor("cuda").cpu().tolist()
    assert st[0] == 2 and st[4] == 1 and st[3] == 8 and (st[1], st[2]) in ((1, 4000), (3, 9))
    with pytest.raises(IndexError, match=r"dst_slots\[(1|3)\] = (4000|9) is out of range"):
        nat.raise_on_device_errors("cuda")
    assert nat.status_tensor("cuda").cpu().tolist() == [0] * 5
    assert torch.equal(dst.tensors[0].cpu(), expected[0])  # only token 2 written


@needs_cuda
def test_copy_rows_cuda_graph_replay():
    rng = np.random.default_rng(14)
    src = Side(rng, 2, 4, 8, 1, 256, (0, 1, 2), 0, 0, False).to("cuda")
    dst = Side(rng, 2, 4, 8, 1, 256, (0, 1, 2), 0, 0, True).to("cuda")
    ss = torch.zeros(16, dtype=torch.int64, device="cuda")
    ds = torch.zeros(16, dtype=torch.int64, device="cuda")
    status = nat.status_tensor("cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run_copy(src, dst, ss, ds, 16, status=status)  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run_copy(src, dst, ss, ds, 16, status=status)
    for seed in range(3):
        r = np.random.default_rng(100 + seed)
        a, b = random_slots(r, 16, 32), random_slots(r, 16, 32)
        ss.copy_(torch.tensor(a)), ds.copy_(torch.tensor(b))
        before = dst.host_copy()
        expected = oracle(src.host_copy(), src, before, dst, a, b, 16, 0)
        g.replay()
        sync("cuda")
        assert torch.equal(dst.tensors[0].cpu(), expected[0])


# ----------------------------------------------------------------------------- rope_reposition


def make_cos_sin(max_pos, rot_dim, dtype):
    """The database's cos/sin table as a host tensor of ``dtype``."""
    return torch.from_numpy(cos_sin_table(max_pos, rot_dim)).to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_rope_matches_oracle(device, dtype, is_neox, packed):
    g = torch.Generator().manual_seed(0)
    T, H, D, rot = 9, 3, 64, 48
    if packed:  # K half of a packed K/V row [T, H, 2, D]
        kv = torch.randn(T, H, 2, D, generator=g).to(dtype)
        key_host = kv[:, :, 0, :]
    else:
        kv = torch.randn(T, H, D, generator=g).to(dtype)
        key_host = kv
    old = torch.tensor([0, 5, 17, -1, 3, 99, 40, 2, 7])
    new = torch.tensor([4, 5, 0, 3, -1, 1, 63, 50, 7], dtype=torch.int32)
    cache = make_cos_sin(100, rot, torch.float32 if dtype == torch.float32 or packed else dtype)
    expected = expected_keys(key_host, old, new, cache, is_neox=is_neox)   # the reference's RoPE
    kv_dev = kv.to(device)
    key = kv_dev[:, :, 0, :] if packed else kv_dev
    nat.rope_reposition(key, old.to(device), new.to(device), cache.to(device), is_neox)
    sync(device)
    # rotated dims within the database's tolerance; dims >= rot_dim and negative-position tokens bit for bit
    assert_rope(key, expected, key_host, old, new, rot=rot, is_neox=is_neox)
    if packed:   # the V half is untouched
        assert torch.equal(kv_dev[:, :, 1, :].cpu(), kv[:, :, 1, :])


def test_rope_out_of_range_raises_before_writing_cpu():
    key = torch.randn(3, 2, 8)
    before = key.clone()
    cache = make_cos_sin(10, 8, torch.float32)
    with pytest.raises(IndexError, match=r"new_positions\[2\] = 10 is out of range: cos_sin_cache holds 10 positions"):
        nat.rope_reposition(key, torch.tensor([1, 2, 3]), torch.tensor([1, 2, 10]), cache, True)
    assert torch.equal(key, before)
    with pytest.raises(ValueError, match="rot_dim"):
        nat.rope_reposition(key, torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3]),
                            make_cos_sin(10, 10, torch.float32), True)


@needs_cuda
def test_rope_status_records_out_of_range():
    key = torch.randn(3, 2, 8, device="cuda")
    before = key.clone()
    cache = make_cos_sin(10, 8, torch.float32).cuda()
    nat.rope_reposition(key, torch.tensor([1, 12, 3], device="cuda"),
                        torch.tensor([1, 2, -1], device="cuda"), cache, False)
    with pytest.raises(IndexError, match=r"old_positions\[1\] = 12 is out of range"):
        sync("cuda")
    assert torch.equal(key[1:], before[1:])


@pytest.mark.parametrize("device", COMPILE_DEVICES)
def test_rope_opcheck_and_compile(device):
    g = torch.Generator().manual_seed(1)
    key = torch.randn(5, 2, 16, generator=g).to(device)
    old = torch.tensor([0, 1, 2, 3, -1], device=device)
    new = torch.tensor([4, 3, 2, 1, 0], device=device)
    cache = make_cos_sin(8, 16, torch.float32).to(device)
    torch.library.opcheck(torch.ops.kvlayout.rope_reposition.default,
                          (key.clone(), old, new, cache, True, 0, nat.status_tensor(device)))

    def f(k, o, n, c):
        nat.rope_reposition(k, o, n, c, True)
        return k * 2

    k1, k2 = key.clone(), key.clone()
    r1 = f(k1, old, new, cache)
    torch._dynamo.reset()
    r2 = torch.compile(f, fullgraph=True)(k2, old, new, cache)
    sync(device)
    assert torch.equal(k1, k2) and torch.equal(r1, r2)


def test_built_backends():
    b = nat.built_backends()
    assert "cpu" in b
    assert set(b) <= {"cpu", "cuda", "xpu"}
