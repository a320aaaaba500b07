"""kvlayout: every KV-cache layout of LLM serving engines, defined once and moved fast.

* ``kvlayout.reference`` - the executable spec (JAX + einops, no torch);
* ``kvlayout.ops`` - the torch op library (C++/CUDA/SYCL kernels);
* ``kvlayout.conformance`` - kernels checked against the spec on each device.
"""

__version__ = "0.1.0"
