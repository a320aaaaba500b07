"""Independent oracles for the compat tests: plain torch indexing, no kvlayout.

For each LMCache GPUKVFormat, ``make_cache`` builds the engine structure and
``rows(fmt, kv, p, l)`` reads plane ``p`` of layer ``l`` as ``[N, H*D]`` by
slicing and permuting the documented physical shape (a copy).  ``logical``
stacks them into ``[P, L, N, H*D]``, which covers every element once, so
comparing logical arrays compares whole caches.
"""

from __future__ import annotations

import enum
import types

import torch

from kvlayout.conformance.families.core import tensor
from kvlayout.conformance.families.rope import cos_sin_table, expected_keys

devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def rand(shape, dtype, device, gen):
    """Random data whose bits all matter (uint8 via randint, floats via randn)."""
    if dtype in (torch.uint8, torch.int8):
        return torch.randint(0, 255, shape, generator=gen, dtype=torch.uint8).view(dtype).to(device)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).to(device)


def make_cache(fmt: int, L, NB, BS, H, D, dtype, device, gen):
    N = NB * BS
    def r(*shape):
        return rand(shape, dtype, device, gen)
    return {
        0: lambda: r(NB, L, 2, BS, H, D),
        1: lambda: [r(2, NB, BS, H, D) for _ in range(L)],
        2: lambda: [r(NB, 2, BS, H, D) for _ in range(L)],
        3: lambda: [r(NB, BS, D) for _ in range(L)],
        4: lambda: [[r(N, H, D) for _ in range(L)], [r(N, H, D) for _ in range(L)]],
        5: lambda: [r(N, 1, D) for _ in range(L)],
        6: lambda: [r(2, NB, H, BS, D) for _ in range(L)],
        7: lambda: [r(NB, 2, H, BS, D) for _ in range(L)],
        8: lambda: r(NB, L, 2, H, BS, D),
        10: lambda: [r(NB, H, BS, 2, D) for _ in range(L)],
        11: lambda: [r(NB, BS, H, 2, D) for _ in range(L)],
    }[int(fmt)]()


def planes(fmt: int) -> int:
    return 1 if int(fmt) in (3, 5) else 2


def rows(fmt: int, kv, p: int, l: int) -> torch.Tensor:
    """Plane p of layer l as [N, W] (slot-major rows), from the documented physical shape."""
    f = int(fmt)
    if f == 0:
        x = kv[:, l, p]                                # [NB, BS, H, D]
    elif f == 1:
        x = kv[l][p]
    elif f == 2:
        x = kv[l][:, p]
    elif f in (3, 5):
        x = kv[l]
    elif f == 4:
        x = kv[p][l]
    elif f == 6:
        x = kv[l][p].permute(0, 2, 1, 3)               # [NB, H, BS, D] -> [NB, BS, H, D]
    elif f == 7:
        x = kv[l][:, p].permute(0, 2, 1, 3)
    elif f == 8:
        x = kv[:, l, p].permute(0, 2, 1, 3)
    elif f == 10:
        x = kv[l][:, :, :, p].permute(0, 2, 1, 3)      # [NB, H, BS, D]
    elif f == 11:
        x = kv[l][:, :, :, p]                          # [NB, BS, H, D]
    else:
        raise ValueError(f)
    n = x.shape[0] * x.shape[1] if f not in (4, 5) else x.shape[0]
    return x.reshape(n, -1)


def num_layers(fmt: int, kv) -> int:
    f = int(fmt)
    return kv.shape[1] if f in (0, 8) else (len(kv[0]) if f == 4 else len(kv))


def logical(fmt: int, kv) -> torch.Tensor:
    L = num_layers(fmt, kv)
    return torch.stack([torch.stack([rows(fmt, kv, p, l) for l in range(L)]) for p in range(planes(fmt))])


def clone(kv):
    if isinstance(kv, torch.Tensor):
        return kv.clone()
    return [clone(x) for x in kv]


def zeros_like(kv):
    if isinstance(kv, torch.Tensor):
        return torch.zeros_like(kv)
    return [zeros_like(x) for x in kv]


def distinct_slots(n, num_slots, gen, device, negatives=()):
    s = torch.randperm(num_slots, generator=gen)[:n].to(torch.int64)
    for i in negatives:
        s[i] = -1
    return s.to(device)


def gather_chunk(logical_cache: torch.Tensor, slots, skip=0, out=None):
    """[P, L, N, W] cache -> [P, L, T, W] chunk: out[:, :, t] = cache[:, :, slots[t]] for valid t."""
    P, L, _, W = logical_cache.shape
    T = len(slots)
    out = torch.zeros(P, L, T, W, dtype=logical_cache.dtype) if out is None else out.clone()
    for t, s in enumerate(slots.tolist()):
        if t >= skip and s >= 0:
            out[:, :, t] = logical_cache[:, :, s]
    return out


def scatter_chunk(logical_cache: torch.Tensor, chunk: torch.Tensor, slots, skip=0):
    """Expected cache after writing chunk [P, L, T, W] at slots (valid tokens only)."""
    out = logical_cache.clone()
    for t, s in enumerate(slots.tolist()):
        if t >= skip and s >= 0:
            out[:, :, s] = chunk[:, :, t]
    return out


def rope_oracle(keys: torch.Tensor, old, new, cos_sin, is_neox: bool) -> torch.Tensor:
    """keys [T, H, D] -> the reference's rotated keys on the host (the one RoPE oracle of the project)."""
    return tensor(expected_keys(keys, old, new, cos_sin, is_neox=is_neox))


def cos_sin_cache(max_pos: int, rot: int) -> torch.Tensor:
    """The case database's float32 cos/sin table ``[max_pos, rot]`` as a host tensor."""
    return torch.from_numpy(cos_sin_table(max_pos, rot))


def bits(x: torch.Tensor) -> torch.Tensor:
    """Bit pattern as integers, for exact comparison of any dtype."""
    x = x.detach().cpu().contiguous()
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def host_zeros(shape, dtype=torch.float32, device="cpu"):
    """Zeroed host memory; pinned when it faces an accelerator (kernels read it directly)."""
    t = torch.zeros(shape, dtype=dtype)
    return t.pin_memory() if str(device) != "cpu" else t


def record_skipped_row(bound: int, device="cpu") -> None:
    """Leave in kvlayout's status tensor what a device kernel records after skipping dst_slots[3] = 999.

    CPU kernels raise at once, so this is how a CPU test reaches the code that
    reports a device kernel's skipped rows.
    """
    from kvlayout.ops import _native
    _native.status_tensor(torch.device(device)).copy_(torch.tensor([1, 3, 999, bound, 1]))


def clear_device_status(device="cpu") -> None:
    from kvlayout.ops import _native
    _native.status_tensor(torch.device(device)).zero_()


# ---------------------------------------------------------------------------------------
# Objects shaped like the engines' (not kvlayout's classes)
# ---------------------------------------------------------------------------------------

class LMCacheFormat(enum.Enum):
    """Like LMCache's MemoryFormat: a plain Enum (not an IntEnum) with the same integer values."""
    UNDEFINED = 0
    KV_2LTD = 1
    KV_T2D = 2
    KV_2TD = 3
    BINARY = 4
    BINARY_BUFFER = 5
    KV_MLA_FMT = 6


class LMCacheLikeObj:
    """An LMCache-shaped memory object: tensor / raw_tensor / get_tensor(i) and metadata.fmt, cached_positions."""

    def __init__(self, tensor, fmt=LMCacheFormat.UNDEFINED, group_tensors=None):
        self._tensors = list(group_tensors) if group_tensors is not None else [tensor]
        self.metadata = types.SimpleNamespace(fmt=fmt, cached_positions=None)

    @property
    def tensor(self):
        return self._tensors[0]

    @property
    def raw_tensor(self):
        return self._tensors[0]

    def get_tensor(self, index):
        return self._tensors[index]


class Metadata:
    """LMCache engine metadata: kv_shape (layers, 2 or 1, chunk, heads, head size), kv_dtype, use_mla, layer groups."""

    def __init__(self, layers=3, chunk=8, heads=2, head_size=8, dtype=torch.float32, use_mla=False, groups=None):
        self.kv_shape = (layers, 1 if use_mla else 2, chunk, heads, head_size)
        self.kv_dtype, self.use_mla, self.chunk_size = dtype, use_mla, chunk
        groups = groups if groups is not None else [list(range(layers))]
        self.kv_layer_groups_manager = types.SimpleNamespace(kv_layer_groups=[
            types.SimpleNamespace(layer_indices=list(g), num_layers=len(g)) for g in groups])


class SGLangLikeMHAPool:
    """An SGLang-shaped MHA device pool: per-layer k_buffer / v_buffer lists [size + page_size, H, D]."""

    def __init__(self, size, page_size, dtype, head_num, head_dim, layer_num, gen, device="cpu", start_layer=0):
        self.size, self.page_size, self.dtype, self.store_dtype = size, page_size, dtype, dtype
        self.head_num, self.head_dim, self.layer_num, self.device = head_num, head_dim, layer_num, device
        self.start_layer, self.end_layer = start_layer, start_layer + layer_num - 1
        shape = (size + page_size, head_num, head_dim)
        self.k_buffer = [rand(shape, dtype, device, gen) for _ in range(layer_num)]
        self.v_buffer = [rand(shape, dtype, device, gen) for _ in range(layer_num)]


class SGLangLikeMLAPool:
    """An SGLang-shaped MLA device pool: a per-layer kv_buffer list [size + page_size, 1, rank + rope]."""

    def __init__(self, size, page_size, dtype, kv_lora_rank, qk_rope_head_dim, layer_num, gen, device="cpu"):
        self.size, self.page_size, self.dtype, self.store_dtype = size, page_size, dtype, dtype
        self.kv_lora_rank, self.qk_rope_head_dim, self.layer_num, self.device = (kv_lora_rank, qk_rope_head_dim,
                                                                                 layer_num, device)
        self.start_layer, self.end_layer = 0, layer_num - 1
        shape = (size + page_size, 1, kv_lora_rank + qk_rope_head_dim)
        self.kv_buffer = [rand(shape, dtype, device, gen) for _ in range(layer_num)]
