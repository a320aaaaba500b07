"""Where an adapter's call runs, index tensors that device can read, and the device's streams."""

from __future__ import annotations

import collections
import contextlib

import torch


def launch_device(*items) -> torch.device:
    """The first non-CPU device among tensors and bound caches (CPU when all are on the host)."""
    for item in items:
        device = item.device
        if device.type != "cpu":
            return device
    return torch.device("cpu")


def indices_on(idx, device: torch.device) -> torch.Tensor:
    """An int index tensor the launch device can read: host indices are copied there unless pinned."""
    if not isinstance(idx, torch.Tensor):
        idx = torch.as_tensor(idx, dtype=torch.int64)
    if idx.device != device and not (idx.device.type == "cpu" and idx.is_pinned()):
        # to the host: a blocking copy, since the host reads the indices next (a non-blocking one may not have landed)
        idx = idx.to(device, non_blocking=device.type != "cpu")
    return idx


def _module(device: torch.device):
    """``torch.cuda`` / ``torch.xpu`` when ``device`` is such a device and the runtime is present, else None."""
    if device is None or device.type not in ("cuda", "xpu"):
        return None
    mod = getattr(torch, device.type, None)
    return mod if mod is not None and mod.is_available() else None


def new_stream(device):
    """A new stream of ``device`` (``None`` on the host, where work is synchronous)."""
    mod = _module(torch.device(device) if device is not None else None)
    return mod.Stream(device) if mod is not None else None


def on_stream(stream):
    """Context manager that makes ``stream`` current (no-op for ``None``)."""
    if stream is None:
        return contextlib.nullcontext()
    return getattr(torch, stream.device.type).stream(stream)


def current_stream(device):
    mod = _module(torch.device(device) if device is not None else None)
    return mod.current_stream(device) if mod is not None else None


def wait_stream(waiter, producer) -> None:
    """``waiter`` waits (on the device, not the host) for the work enqueued on ``producer`` so far."""
    if waiter is not None and producer is not None:
        waiter.wait_stream(producer)


def synchronize_stream(stream) -> None:
    if stream is not None:
        stream.synchronize()


class InFlight:
    """Keeps the tensors that work enqueued on a stream uses from being reused before that work has run.

    The caching allocators know only the stream a tensor was allocated on: a
    tensor the caller made (slots, memory objects) or a buffer allocated on
    another stream, used by work on a stream the adapter chose and then freed
    by its owner, could be handed out again (and written) while that work
    still reads or writes it.  :meth:`keep` records each device tensor on the
    stream (``Tensor.record_stream``); a host tensor (pinned memory a kernel
    reads or writes directly), or one whose device cannot record, is held
    here until an event recorded after the work has passed, and released by a
    later :meth:`keep` (or :meth:`release_finished`).
    """

    def __init__(self):
        self._held: collections.deque = collections.deque()     # (event, tensors) in stream order

    def keep(self, stream, *tensors) -> None:
        """Make ``tensors`` (``None`` entries are ignored) outlive the work enqueued on ``stream`` so far.
        ``stream`` ``None`` (the host: synchronous) does nothing."""
        if stream is None:
            return
        self.release_finished()
        held = []
        for t in tensors:
            if t is None:
                continue
            if t.device.type == stream.device.type:
                try:
                    t.record_stream(stream)
                    continue
                except (RuntimeError, NotImplementedError):     # a device whose allocator cannot record
                    pass
            held.append(t)
        if held:
            event = _module(stream.device).Event()
            event.record(stream)
            self._held.append((event, held))

    def release_finished(self) -> None:
        """Let go of the tensors whose work has run."""
        while self._held and self._held[0][0].query():
            self._held.popleft()

    def __len__(self) -> int:
        """Tensors still held."""
        return sum(len(t) for _, t in self._held)


__all__ = ["launch_device", "indices_on", "new_stream", "on_stream", "current_stream", "wait_stream",
           "synchronize_stream", "InFlight"]
