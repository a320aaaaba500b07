"""Module-level locks that a fork cannot leave held.

An engine may fork its workers (``os.fork``, multiprocessing's fork start
method) while other threads call kvlayout. A lock held by one of them at that
moment would stay held in the child, by a thread the child does not have, and
the child's first call needing it would wait forever. A lock made here is
taken by the forking thread around every ``os.fork()``, so the child starts
with it free and the state it guards whole (the native tables' locks do the
same in C++, ``torch_ext/program.cpp``).
"""

from __future__ import annotations

import os


def fork_safe(lock):
    """``lock`` (a ``threading.Lock`` or ``RLock``), acquired before and released after every ``os.fork()``."""
    os.register_at_fork(before=lock.acquire, after_in_parent=lock.release, after_in_child=lock.release)
    return lock
