"""Engine-compatible surfaces built on kvlayout.ops (no kernels of their own).

* ``kvlayout.compat.lmcache`` - LMCache's transfer ops (``multi_layer_kv_transfer``
  and friends), its format enums and format discovery, with tensors where
  LMCache takes pointer arrays.
* ``kvlayout.compat.connectors`` - LMCache's GPU/XPU connectors (paged V2/V3,
  layer-wise, CacheBlend buffer, SGLang) as one device-agnostic implementation.
* ``kvlayout.compat.sglang`` - SGLang's ``transfer_kv_*`` family, the HiCache
  host pool (all layouts, io backends ``kernel``/``direct``) and device pools.

Every adapter only picks catalog layout names, binds the engine's tensors,
computes slot lists or skip counts and calls ``kvlayout.ops``.  Modules are
imported on first use so ``import kvlayout.compat`` stays cheap.
"""

import importlib

__all__ = ["lmcache", "connectors", "sglang"]


def __getattr__(name):
    if name in __all__:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'kvlayout.compat' has no attribute {name!r}")
