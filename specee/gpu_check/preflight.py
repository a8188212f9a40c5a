"""The GPU check's preflight: the packages the steps import against the project's own floors
(pyproject.toml), that they import together, and the GPU's free memory and conditional-node support;
each finding one line with its fix, the blocking ones stopping the check before any step."""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Callable

from specee.errors import one_line
from specee.gpu_check.steps import conditional_nodes_missing
from specee.io import PROJECT_ROOT as ROOT


NEED_FREE_GIB = 24  # Llama-2-7B in fp16 (12.6 GiB), its KV caches, CUDA-graph pools, HF's static cache

# What the steps import, with the project's own requirement for each (pyproject.toml). lm-eval,
# pandas and the plotting stack are not needed: no step runs an accuracy task or draws a figure.
NEEDED = ("torch", "transformers", "tokenizers", "safetensors", "hydra-core", "omegaconf", "nvidia-ml-py", "tqdm")

# hydra-core 1.3 parses overrides with this exact runtime (its own pin, not the project's)
EXTRA = {"antlr4-python3-runtime": "==4.9.*"}

# Never reinstalled on the GPU machine: its CUDA build is the image's, and a wheel is gigabytes.
KEEP_IMAGES = {"torch"}

def project_requirements(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """name -> version specifier, for the packages the steps need, read from pyproject.toml."""
    import tomllib
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    reqs = {}
    for d in deps:
        m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(.*)", d)
        reqs[m.group(1).lower()] = m.group(2).replace(" ", "")
    out = {n: reqs.get(n, "") for n in NEEDED}
    out.update(EXTRA)
    return out

def installed_version(dist: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None

def satisfies(version: str, spec: str) -> bool:
    if not spec:
        return True
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version
        return Version(version) in SpecifierSet(spec)
    except ImportError:  # packaging comes with transformers; without it, compare the leading numbers
        def nums(v):
            return tuple(int(x) for x in re.findall(r"\d+", v)[:3])
        return all(nums(version) >= nums(s[2:]) for s in spec.split(",") if s.startswith(">="))

def fix_for(dist: str, spec: str, missing: bool = False) -> str:
    if dist in KEEP_IMAGES and missing:
        return f"a machine whose image has a CUDA build of {dist} (docs/gpu.md: install on a GPU)"
    if dist in KEEP_IMAGES:
        return (f"keep the image's CUDA build (a torch wheel is gigabytes and pulls CUDA); {dist}{spec} is the "
                "project's pin, an older one only loses what the plan says")
    return f"pip install --no-index --no-deps --find-links WHEELS '{dist}{spec}' (wheels carried in: docs/gpu.md)"

def probe_gpu() -> dict:
    """This machine's GPU as the steps will see it (``cuda``: False where there is none)."""
    import torch
    if not torch.cuda.is_available():
        return {"cuda": False}
    free, total = torch.cuda.mem_get_info(0)
    p = torch.cuda.get_device_properties(0)
    info = {"cuda": True, "gpu": p.name, "memory_gib": round(total / 2**30, 1), "free_gib": round(free / 2**30, 1),
            "cuda_version": torch.version.cuda, "conditional_nodes_missing": conditional_nodes_missing()}
    try:
        import pynvml
        pynvml.nvmlInit()
        info["driver"] = pynvml.nvmlSystemGetDriverVersion()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        info["gpu_utilization_pct"] = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
    except Exception as err:  # noqa: BLE001 - a finding, said in the preflight
        info["nvml_error"] = f"{type(err).__name__}: {err}"
    return info

IMPORTS = {"transformers": "transformers", "hydra": "hydra-core", "omegaconf": "omegaconf", "pynvml": "nvidia-ml-py"}

def preflight(dry_run_: bool, version_of: Callable[[str], str | None] = installed_version,
              gpu: Callable[[], dict] = probe_gpu, requirements: dict | None = None,
              import_module: Callable = __import__) -> dict:
    """Versions against the project's floors, the GPU's free memory and conditional-node support.
    Each finding is one line with its fix; ``blocking`` ones stop the check before any step."""
    findings, versions = [], {}
    if sys.version_info < (3, 11):
        py = ".".join(map(str, sys.version_info[:3]))
        findings.append({"what": "python", "blocking": True,
                         "line": f"Python {py} is below the project's requires-python >=3.11 (pyproject.toml); fix: "
                                 "run the check with a Python >= 3.11 that has the image's torch"})
        return {"versions": {"python": py}, "requirements": {}, "findings": findings}
    reqs = requirements or project_requirements()
    for dist, spec in reqs.items():
        v = version_of(dist)
        versions[dist] = v
        if v is None:
            findings.append({"what": dist, "blocking": True,
                             "line": f"{dist} is not installed (the project needs {dist}{spec}); "
                                     f"fix: {fix_for(dist, spec, True)}"})
        elif not satisfies(v, spec):
            blocking = dist not in KEEP_IMAGES
            findings.append({"what": dist, "blocking": blocking,
                             "line": f"{dist} {v} is outside the project's requirement {dist}{spec} (pyproject.toml)"
                                     f"; fix: {fix_for(dist, spec)}"})
    report = {"versions": versions, "requirements": reqs, "findings": findings}
    if any(f["blocking"] for f in findings):
        return report  # the GPU is not probed with a broken stack: the first fix comes first
    # Right versions can still fail to import together (a newer transformers over the image's
    # huggingface_hub or tokenizers): every step would die at its first line.
    for module, dist in IMPORTS.items():
        try:
            import_module(module)
        except Exception as err:  # noqa: BLE001 - said as a finding, with its fix
            findings.append({"what": dist, "blocking": True,
                             "line": f"import {module} fails ({type(err).__name__}: {one_line(err)[:300]}); fix: "
                                     "carry the wheel of the package it names and pip install --no-index --no-deps "
                                     "it (docs/gpu.md)"})
    if any(f["blocking"] for f in findings):
        return report
    if dry_run_:
        report["gpu"] = {"cuda": False, "note": "dry run: every step on the CPU"}
        return report
    g = report["gpu"] = gpu()
    if not g.get("cuda"):
        findings.append({"what": "gpu", "blocking": True,
                         "line": "no CUDA GPU is visible to torch; fix: run it on the GPU machine, or with "
                                 "--dry-run on a CPU"})
        return report
    if g["free_gib"] < NEED_FREE_GIB:
        findings.append({"what": "gpu memory", "blocking": True,
                         "line": f"{g['free_gib']} GiB free of {g['memory_gib']} GiB on {g['gpu']}; the 7B steps need "
                                 f"{NEED_FREE_GIB} GiB; fix: end the processes nvidia-smi lists on it"})
    if g.get("conditional_nodes_missing"):
        findings.append({"what": "conditional nodes", "blocking": False,
                         "line": f"{g['conditional_nodes_missing']}: llama2_7b_t1_t2_device is skipped; fix: torch "
                                 ">= 2.13 built with CUDA >= 12.4 (the image's torch is kept: not installed here)"})
    if g.get("nvml_error"):
        findings.append({"what": "nvml", "blocking": False,
                         "line": f"NVML does not answer ({g['nvml_error']}): energy figures will be blank; fix: a "
                                 "driver with NVML (nvidia-smi runs), nvidia-ml-py installed"})
    elif (g.get("gpu_utilization_pct") or 0) > 5:
        findings.append({"what": "gpu busy", "blocking": False,
                         "line": f"the GPU is {g['gpu_utilization_pct']} % busy before the check: timings will be "
                                 "noise; fix: end the other processes on it"})
    return report

OFFLINE_RECIPE = """\
On a machine with network (same Python version as the GPU machine), next to the checkout:
    pip download --no-deps -d wheels 'transformers>=5.20,<6' 'hydra-core>=1.3.2,<1.4' 'omegaconf>=2.3,<2.5' \\
        'nvidia-ml-py>=12' && pip wheel --no-deps -w wheels antlr4-python3-runtime==4.9.3
On the GPU machine (no network; torch is the image's, never reinstalled; the project is not
installed: the check runs from the checkout):
    pip install --no-index --no-deps wheels/*.whl && python scripts/gpu_check.py --out gpu_out"""
