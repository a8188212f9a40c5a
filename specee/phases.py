"""The clocks a decoding step is timed with: :class:`Clock` (waits for queued GPU work) and
:class:`PhaseTimer` (bills a step's time to its phases and counts host syncs). A root module: the
runtime's layer walk, the decoders and predictor-data collection all take a timer."""
from __future__ import annotations

import time
from collections import defaultdict

import torch

PHASES = ("layers", "predictors", "verification", "draft", "other")


class Clock:
    """perf_counter that first waits for queued GPU work, so a reading covers what ran."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)  # the model's GPU, not the current one (cuda:0)
        return time.perf_counter()


class PhaseTimer:
    """Bills the time of one decoding step to phases (layers, predictors, verification, draft,
    other) and counts host syncs.

    On a CPU ops run synchronously, so the wall clock between phase boundaries is each phase's
    time. On CUDA a boundary read without a sync bills queued work to whichever phase waits on
    the host next, so phases are read only in a *profiling* pass (``profile=True``: a sync at
    each boundary, which itself costs time); the throughput pass (``profile=False``) reads none.
    """

    def __init__(self, device, profile: bool = False):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.enabled = profile or not cuda
        self.sync = cuda and profile
        self.method = ("synchronized wall clock, separate profiling pass (CUDA)" if self.sync else
                       "wall clock (CPU: ops run synchronously)" if not cuda else "not measured (CUDA throughput pass)")
        self.phases: dict[str, float] = defaultdict(float)
        self.syncs = 0
        self._t = 0.0

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self.phases = defaultdict(float)
        self.syncs = 0
        if self.enabled:
            self._t = self._now()

    def lap(self, phase: str) -> None:
        """Bill the time since the last boundary to ``phase``."""
        if self.enabled:
            now = self._now()
            self.phases[phase] += now - self._t
            self._t = now

    # Host reads of device values: each is a sync on a GPU, counted.
    def host_int(self, x: torch.Tensor) -> int:
        self.syncs += 1
        return int(x)

    def host_bool(self, x: torch.Tensor) -> bool:
        self.syncs += 1
        return bool(x)

    def start_read(self, x: torch.Tensor, async_copy: bool | None = None):
        """Begin reading a device value without waiting: on CUDA (``async_copy``, default: ``x`` is
        on CUDA) a copy into pinned memory and an event behind it, so the host can queue more work
        first; :meth:`finish_read` waits (the sync, counted there). Off CUDA it is readable now."""
        if x.is_cuda if async_copy is None else async_copy:
            buf = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
            buf.copy_(x, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            return buf, event
        return x, None

    def finish_read(self, handle) -> bool:
        buf, event = handle
        if event is not None:
            event.synchronize()
        self.syncs += 1
        return bool(buf)

    def host_list(self, x: torch.Tensor) -> list:
        self.syncs += 1
        return x.tolist()

    # Host data copied to the device: from pageable memory CUDA waits for the stream first, so
    # on a GPU this is a sync as well, and counted like one.
    def to_device(self, data, dtype=None) -> torch.Tensor:
        self.syncs += 1
        return torch.tensor(data, dtype=dtype, device=self.device)

    def trace(self) -> dict:
        """t_layers, t_pred, t_verify, t_draft, t_other (seconds) and syncs of this step."""
        p = self.phases
        return {"t_layers": p["layers"], "t_pred": p["predictors"], "t_verify": p["verification"],
                "t_draft": p["draft"], "t_other": p["other"], "syncs": self.syncs}
