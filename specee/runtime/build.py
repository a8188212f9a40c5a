"""Which runtime a config asks for: the eager layer walk (specee/runtime/layerwise.py, the
reference) or the compiled one (specee/runtime/compiled.py, built on it). Chosen here, above both,
so the reference runtime never imports the compiled one that extends it."""
from __future__ import annotations

from specee.errors import SpeceeError
from specee.runtime.layerwise import LayerwiseLM


def build_runtime(runtime_cfg, model) -> LayerwiseLM:
    """The configured runtime over a loaded model: ``eager`` (the reference) or ``compiled``
    (specee/runtime/compiled.py, imported only when asked for)."""
    kind = runtime_cfg.kind
    if kind == "eager":
        rt = LayerwiseLM(model)
        rt.exit_control = getattr(runtime_cfg, "exit_control", "host")
        return rt
    if kind == "compiled":
        from specee.runtime.compiled import CompiledLM
        return CompiledLM(model, runtime_cfg.compile_mode, runtime_cfg.max_block, runtime_cfg.cache_bucket,
                          exit_control=getattr(runtime_cfg, "exit_control", "host"))
    raise SpeceeError(f"runtime.kind={kind!r} is unknown; valid: eager, compiled")
