"""Energy over measured regions: the NVML energy counter (plus sampled power) on NVIDIA GPUs,
RAPL on CPUs that expose it; otherwise the metric is reported unavailable with the reason —
never a made-up number.

    meter = EnergyMeter.for_device("cuda:0")
    with meter.region():  # one long window (NVML's counter advances about every 100 ms)
        for ids in prompts: decoder.generate(ids, ...)
    meter.summary(tokens)  # {"available": True, "source": "nvml", "joules": ..., ...}
"""
from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import torch

from specee.env import nvml_handle

RAPL = Path("/sys/class/powercap")


class _NVML:
    source = "nvml"

    def __init__(self, index: int):
        import pynvml
        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle, self.matched_by = self._handle(pynvml, index)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)  # raises where unsupported

    _handle = staticmethod(nvml_handle)  # one implementation (specee/env.py), used by the GPU info too

    def energy_j(self) -> float:
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1e3  # mJ -> J

    def power_w(self) -> None:
        # The total-energy counter needs no power sampling; its updates are counted instead.
        return None

    # The counter advances about every 100 ms: a window of a few updates is quantised, so the
    # windows are long (one per side over all prompts, untimed) and their updates are counted.
    poll_s = 0.01


class _RAPL:
    source = "rapl"

    def __init__(self):
        self.zones = [z for z in sorted(RAPL.glob("intel-rapl:[0-9]*")) if (z / "energy_uj").is_file()]
        if not self.zones:
            raise OSError("no RAPL package zones")
        self.ranges = [int((z / "max_energy_range_uj").read_text()) for z in self.zones]
        self.last = [self._read(z) for z in self.zones]
        self.total = 0.0

    @staticmethod
    def _read(zone: Path) -> int:
        return int((zone / "energy_uj").read_text())  # PermissionError when not readable

    def energy_j(self) -> float:
        for i, z in enumerate(self.zones):
            now = self._read(z)
            delta = now - self.last[i]
            self.total += (delta if delta >= 0 else delta + self.ranges[i]) / 1e6  # counter wraps
            self.last[i] = now
        return self.total

    def power_w(self) -> float | None:
        return None


class EnergyMeter:
    def __init__(self, backend=None, reason: str | None = None, device=None):
        self.backend, self.reason = backend, reason
        self.device = torch.device(device) if device is not None else None
        self.joules = 0.0
        self.seconds = 0.0
        self.samples: list[float] = []
        self.windows = 0
        self.counter_updates = 0  # distinct counter values seen inside windows (polled backends)
        self.min_updates_per_window: int | None = None

    @classmethod
    def for_device(cls, device) -> "EnergyMeter":
        dev = torch.device(device)
        if dev.type == "cuda":
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            try:
                return cls(_NVML(index), device=dev)
            except ImportError:
                return cls(None, "nvidia-ml-py (pynvml) is not installed", dev)
            except Exception as err:  # noqa: BLE001 - NVML errors have many types
                return cls(None, f"NVML energy counter unavailable: {err}", dev)
        try:
            return cls(_RAPL(), device=dev)
        except (OSError, ValueError) as err:
            return cls(None, f"no readable RAPL counter under {RAPL} ({err.__class__.__name__}: {err})", dev)

    def _sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the measured GPU, not the current one

    @property
    def available(self) -> bool:
        return self.backend is not None

    @contextlib.contextmanager
    def region(self):
        """Accumulate energy and time over the enclosed work (call after synchronising)."""
        if not self.available:
            yield
            return
        stop = threading.Event()
        sampler = None
        seen: set[float] = set()
        if self.backend.power_w() is not None:
            def sample():
                while not stop.wait(self.backend.sample_s):
                    self.samples.append(self.backend.power_w())
            sampler = threading.Thread(target=sample, daemon=True)
        elif getattr(self.backend, "poll_s", None):
            def sample():
                while not stop.wait(self.backend.poll_s):
                    seen.add(self.backend.energy_j())
            sampler = threading.Thread(target=sample, daemon=True)
        self._sync()
        e0, t0 = self.backend.energy_j(), time.perf_counter()
        seen.add(e0)
        if sampler:
            sampler.start()
        try:
            yield
        finally:
            self._sync()
            e1 = self.backend.energy_j()
            self.joules += e1 - e0
            self.seconds += time.perf_counter() - t0
            if sampler:
                stop.set()
                sampler.join()
            self.windows += 1
            if getattr(self.backend, "poll_s", None):
                seen.add(e1)
                updates = len(seen) - 1
                self.counter_updates += updates
                self.min_updates_per_window = (updates if self.min_updates_per_window is None
                                               else min(self.min_updates_per_window, updates))

    def summary(self, tokens: int) -> dict:
        if not self.available:
            return {"available": False, "reason": self.reason}
        out = {"available": True, "source": self.backend.source, "joules": self.joules,
               **({"nvml_device_matched_by": self.backend.matched_by} if hasattr(self.backend, "matched_by") else {}),
               "seconds": self.seconds, "joules_per_token": self.joules / tokens if tokens else None,
               "mean_watts": self.joules / self.seconds if self.seconds else None}
        if self.samples:
            out["sampled_mean_watts"] = sum(self.samples) / len(self.samples)
            out["power_samples"] = len(self.samples)
        out["windows"] = self.windows
        if getattr(self.backend, "poll_s", None):
            out["counter_updates"] = self.counter_updates
            out["min_counter_updates_per_window"] = self.min_updates_per_window
            if (self.min_updates_per_window or 0) < 10:
                out["quantised"] = ("fewer than 10 energy-counter updates in a window: the figure is "
                                    "quantised by the counter's update period (±10% or worse)")
        return out
