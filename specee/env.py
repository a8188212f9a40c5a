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
