"""kvlayout's torch op library: layouts as strided views, one native copy op.

Bind the tensors an engine already has to a catalog layout, then move rows::

    from kvlayout import ops
    vllm = ops.bind("vllm_flash_attn_nhd", kv_caches)          # list[L] of [2, NB, BS, H, D]
    chunk = ops.bind("lmcache_kv_2ltd", memobj)                 # [2, L, T, H*D]
    ops.transfer(vllm, chunk, slot_mapping)                     # gather into the chunk

A layer-wise pipeline prepares the transfer once and runs one layer per call::

    t = ops.prepare(vllm, chunk, slot_mapping)
    for i in range(t.num_layers):
        t.layer(i)

Every cache the library keeps is bounded (``cache_info``, ``set_cache_capacity``).

Operations (same names and rules as ``kvlayout.reference``): ``transfer``,
``gather``, ``scatter``, ``move``, ``skip_prefix``, page helpers
(``get_page``, ``set_page``, ``zero_page``, ``page_spans``,
``page_buffer_meta``), ``rope_reposition``.  Native ops:
``torch.ops.kvlayout.copy_rows``, ``torch.ops.kvlayout.copy_program`` (a registered
copy program, ``kvlayout.ops.program``) and ``torch.ops.kvlayout.rope_reposition``.
"""

from ._native import set_host_cache_hints, set_host_launch_shape
from .caches import cache_info, set_cache_capacity
from .calibration import calibrate
from .pages import dummy_flat_page, get_page, page_buffer_meta, page_spans, set_page, zero_page
from .prepared import PreparedTransfer, prepare
from .programs import plan
from .rope import rope_reposition
from .staged import release_staging, set_staged_chunks, set_staged_graph_launch, set_staged_graph_reuse
from .transfer import check_errors, explain, gather, move, scatter, skip_prefix, transfer
from .views import KVCache, bind

__all__ = ["KVCache", "bind", "transfer", "explain", "prepare", "PreparedTransfer", "gather", "scatter", "move",
           "skip_prefix", "check_errors", "plan", "get_page", "set_page", "zero_page", "page_spans",
           "page_buffer_meta", "dummy_flat_page", "rope_reposition", "release_staging", "set_staged_chunks",
           "set_staged_graph_launch", "set_staged_graph_reuse",
           "set_host_cache_hints", "set_host_launch_shape", "cache_info", "set_cache_capacity", "calibrate"]
