"""Energy over measured regions: the NVML energy counter (plus sampled power) on NVIDIA GPUs,
RAPL on CPUs that expose it; otherwise the metric is reported unavailable with the reason —
never a made-up number.

    meter = EnergyMeter.for_device("cuda:0")
    with meter.region():
        decoder.generate(...)
    meter.summary(tokens)  # {"available": True, "source": "nvml", "joules": ..., ...}
"""
from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import torch

RAPL = Path("/sys/class/powercap")


class _NVML:
    source = "nvml"

    def __init__(self, index: int):
        import pynvml
        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle, self.matched_by = self._handle(pynvml, index)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)  # raises where unsupported

    @staticmethod
    def _handle(pynvml, index: int):
        """The NVML handle of CUDA device ``index``. CUDA ordinals are renumbered by
        CUDA_VISIBLE_DEVICES (and ordered differently from NVML's), so match by UUID, then by PCI
        bus id; a bare index is never used."""
        props = torch.cuda.get_device_properties(index)
        uuid = str(getattr(props, "uuid", "") or "")
        if uuid:
            try:
                return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"), "uuid"
            except Exception:  # noqa: BLE001 - fall through to the bus id
                pass
        if hasattr(props, "pci_bus_id"):
            bus = f"{getattr(props, 'pci_domain_id', 0):08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
            return pynvml.nvmlDeviceGetHandleByPciBusId(bus), "pci_bus_id"
        raise RuntimeError(f"cannot map CUDA device {index} to an NVML device (no UUID or PCI bus id)")

    def energy_j(self) -> float:
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1e3  # mJ -> J

    def power_w(self) -> None:
        # The total-energy counter needs no sampling thread; one would share the host with the
        # timed region's kernel launches.
        return None


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
    def __init__(self, backend=None, reason: str | None = None):
        self.backend, self.reason = backend, reason
        self.joules = 0.0
        self.seconds = 0.0
        self.samples: list[float] = []

    @classmethod
    def for_device(cls, device) -> "EnergyMeter":
        dev = torch.device(device)
        if dev.type == "cuda":
            try:
                return cls(_NVML(dev.index or 0))
            except ImportError:
                return cls(None, "nvidia-ml-py (pynvml) is not installed")
            except Exception as err:  # noqa: BLE001 - NVML errors have many types
                return cls(None, f"NVML energy counter unavailable: {err}")
        try:
            return cls(_RAPL())
        except (OSError, ValueError) as err:
            return cls(None, f"no readable RAPL counter under {RAPL} ({err.__class__.__name__}: {err})")

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
        if self.backend.power_w() is not None:
            def sample():
                while not stop.wait(self.backend.sample_s):
                    self.samples.append(self.backend.power_w())
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
        e0, t0 = self.backend.energy_j(), time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.joules += self.backend.energy_j() - e0
            self.seconds += time.perf_counter() - t0
            if sampler:
                stop.set()
                sampler.join()

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
        return out
