"""How far a running forward has got, layer by layer, for whoever reads the
KV it writes while it runs (a prefill worker streaming KV to decode).

The engine thread calls ``layer_done(i)`` once layer ``i`` wrote its K/V
(on CUDA: once its kernels are launched, with an event recorded behind
them), then ``finish()`` when the step's results are read back, or
``fail(error)``. A reader's ``wait(i)`` blocks until layer ``i`` is done and
returns its CUDA event (None on the CPU, where done means written): a
reader on the GPU orders its own work after the event; one on the host
synchronizes on it first (``host_wait``)."""
from __future__ import annotations

import threading
import time

import torch


class StepFailed(RuntimeError):
    pass


class LayerProgress:
    def __init__(self, num_layers: int, device, timeout_s: float = 600.0):
        self.num_layers, self.timeout_s = num_layers, timeout_s
        self.on_cuda = torch.device(device).type == "cuda"
        self.events: list = []
        self.error: BaseException | None = None
        self.computed_at: float | None = None
        self._cond = threading.Condition()

    def layer_done(self, i: int) -> None:
        event = None
        if self.on_cuda:
            event = torch.cuda.Event()
            event.record()
        with self._cond:
            if i != len(self.events):
                raise RuntimeError(f"layer {i} done out of order (expected {len(self.events)})")
            self.events.append(event)
            self._cond.notify_all()

    def finish(self) -> None:
        with self._cond:
            self.computed_at = time.perf_counter()
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self.error = error
            self._cond.notify_all()

    def wait(self, i: int, timeout: float | None = None):
        timeout = self.timeout_s if timeout is None else timeout
        with self._cond:
            ended = lambda: self.error is not None or self.computed_at is not None  # noqa: E731
            if not self._cond.wait_for(lambda: ended() or len(self.events) > i, timeout):
                raise StepFailed(f"layer {i} not computed within {timeout}s")
            if len(self.events) <= i:
                raise StepFailed(f"the forward ended before layer {i}: {self.error or 'layer never reported'}")
            return self.events[i]

    def host_wait(self, i: int, timeout: float | None = None) -> None:
        event = self.wait(i, timeout)
        if event is not None:
            event.synchronize()

    def wait_computed(self, timeout: float | None = None) -> float:
        """When the step's compute ended (``perf_counter``), once it has."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.error is not None or self.computed_at is not None, timeout):
                raise StepFailed(f"the step did not end within {timeout}s")
            if self.computed_at is None:
                raise StepFailed(f"the forward failed: {self.error}")
            return self.computed_at


class ShiftedGate:
    """A gate on layers ``first``.. of a forward's progress, counted from 0 (a ``PiecewiseKV`` of a layer range)."""

    def __init__(self, progress: LayerProgress, first: int):
        self.progress, self.first = progress, first

    def host_wait(self, i: int, timeout: float | None = None) -> None:
        self.progress.host_wait(self.first + i, timeout)
