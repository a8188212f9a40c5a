"""Describe the machine and software a result came from."""
from __future__ import annotations

import os
import platform
import subprocess
import time
from importlib import metadata

import torch

from specee.io import PROJECT_ROOT


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_caches() -> dict:
    """The first CPU's cache sizes by level and type (Linux sysfs), e.g. {"L1d": "32K", "L2": "1024K"}:
    a CPU speed ratio depends on them (which weights stay resident), so every result records them."""
    from pathlib import Path
    out = {}
    for d in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind, size = ((d / f).read_text().strip() for f in ("level", "type", "size"))
        except OSError:
            continue
        out[f"L{level}" + {"Data": "d", "Instruction": "i"}.get(kind, "")] = size
    return out


def _cpu_flags() -> list[str]:
    """The vector-extension flags that decide which matmul kernels run (oneDNN picks by them)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return sorted(f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))
    except OSError:
        pass
    return []


def _git() -> dict:
    def git(*args):
        return subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD") or None,
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def nvml_handle(pynvml, index: int):
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


def gpu_info() -> list[dict]:
    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                     "capability": f"{p.major}.{p.minor}"})
    try:
        import pynvml
        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        for g in gpus:
            # torch's ordinal is not NVML's under CUDA_VISIBLE_DEVICES: match by UUID / bus id.
            h, _ = nvml_handle(pynvml, g["index"])
            g["driver"] = driver.decode() if isinstance(driver, bytes) else driver
            g["sm_clock_mhz"] = pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
            g["mem_clock_mhz"] = pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)
            g["max_sm_clock_mhz"] = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM)
        pynvml.nvmlShutdown()
    except Exception as err:  # noqa: BLE001 - NVML is optional; say why it is missing
        for g in gpus:
            g["nvml"] = f"unavailable: {err}"
    return gpus


def _cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [float(x) for x in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)
    return sum(vals) - idle, sum(vals)


# NVML's utilisation covers its last sample period (1/6 s to 1 s by product): read it only after
# this process has left its GPU idle that long, or it reports our own warm-up as someone else's.
GPU_IDLE_S = 1.1


def _gpu_utilization(device: torch.device) -> int | None:
    """Utilisation (%) of the GPU ``device`` names, matched to NVML by UUID, not by ordinal."""
    try:
        import pynvml
        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        handle, _ = nvml_handle(pynvml, index)
        return int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:  # noqa: BLE001 - optional
        return None


def machine_load(sample_s: float = 0.5, device=None) -> dict:
    """How busy the machine is besides this process: the 1-minute load average and the share of
    all CPU time other processes used over ``sample_s`` (and, for a CUDA ``device``, that GPU's
    utilisation while this process leaves it idle). A timing taken on a busy machine is noise."""
    out: dict = {"cpu_count": os.cpu_count()}
    dev = torch.device(device) if device is not None else None
    gpu = dev is not None and dev.type == "cuda" and torch.cuda.is_available()
    if gpu:
        torch.cuda.synchronize(dev)  # our queued work ends here; the idle period starts
    idle0 = time.perf_counter()
    try:
        out["loadavg_1min"] = round(os.getloadavg()[0], 2)
        b0, t0 = _cpu_times()
        own0 = sum(os.times()[:2])
        time.sleep(sample_s)
        b1, t1 = _cpu_times()
        own = sum(os.times()[:2]) - own0
        ticks = os.sysconf("SC_CLK_TCK")
        total = max(t1 - t0, 1e-9)
        out["other_cpu_share"] = round(max(0.0, (b1 - b0) - own * ticks) / total, 3)
    except (OSError, ValueError, IndexError):
        out["other_cpu_share"] = None
    if gpu:
        time.sleep(max(0.0, GPU_IDLE_S - (time.perf_counter() - idle0)))
        util = _gpu_utilization(dev)
        if util is not None:
            out["gpu_utilization_pct"] = [util]  # the GPU in use only; others' load is not ours
    # The load average also counts this sweep's previous job, so only other processes' share now
    # (and a GPU someone else is using) decide "busy".
    busy = (out.get("other_cpu_share") or 0) > 0.2 or any(u > 10 for u in out.get("gpu_utilization_pct", []))
    out["busy"] = bool(busy)
    return out


def environment(dtype: str | None = None, seed: int | None = None) -> dict:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {p: _version(p) for p in ("torch", "transformers", "tokenizers", "lm_eval",
                                               "hydra-core", "omegaconf", "specee")},
        "cpu": _cpu_model(),
        "cpu_caches": _cpu_caches(),
        "cpu_vector_flags": _cpu_flags(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "gpus": gpu_info(),
        "dtype": dtype,
        "seed": seed,
        "git": _git(),
    }
