"""Describe the machine and software a result came from."""
from __future__ import annotations

import os
import platform
import subprocess
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


def _git() -> dict:
    def git(*args):
        return subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD") or None,
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


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
            h = pynvml.nvmlDeviceGetHandleByIndex(g["index"])
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


def machine_load(sample_s: float = 0.5) -> dict:
    """How busy the machine is besides this process: the 1-minute load average and the share of
    all CPU time other processes used over ``sample_s`` (and GPU utilisation where NVML has it).
    A timing taken on a busy machine is noise."""
    out: dict = {"cpu_count": os.cpu_count()}
    try:
        out["loadavg_1min"] = round(os.getloadavg()[0], 2)
        b0, t0 = _cpu_times()
        own0 = sum(os.times()[:2])
        import time
        time.sleep(sample_s)
        b1, t1 = _cpu_times()
        own = sum(os.times()[:2]) - own0
        ticks = os.sysconf("SC_CLK_TCK")
        total = max(t1 - t0, 1e-9)
        out["other_cpu_share"] = round(max(0.0, (b1 - b0) - own * ticks) / total, 3)
    except (OSError, ValueError, IndexError):
        out["other_cpu_share"] = None
    if torch.cuda.is_available():
        try:
            import pynvml
            pynvml.nvmlInit()
            out["gpu_utilization_pct"] = [pynvml.nvmlDeviceGetUtilizationRates(
                pynvml.nvmlDeviceGetHandleByIndex(i)).gpu for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # noqa: BLE001 - optional
            pass
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
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "gpus": gpu_info(),
        "dtype": dtype,
        "seed": seed,
        "git": _git(),
    }
