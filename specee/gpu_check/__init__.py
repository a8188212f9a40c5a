"""The project's GPU check (``python scripts/gpu_check.py``, docs/gpu.md), one module per job:

- ``steps``: the steps, their budget, their CPU dry-run form and the plan;
- ``preflight``: packages, imports and the GPU, checked before any step;
- ``runner``: the steps run, each in its own process group, under the budget;
- ``outputs``: the output folder (one file per step, logs, atomic writes);
- ``goals``: the figures and GPU-only checks read from each step, and the goal table;
- ``summary``: summary.json and summary.md, rebuilt from the step files.
"""
