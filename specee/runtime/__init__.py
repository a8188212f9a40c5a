"""The runtimes: how a Hugging Face decoder runs layer by layer under the harness.

- ``layerwise``: :class:`LayerwiseLM`, the eager reference (the model's own layers, a per-layer K/V
  cache, the layer walk that exits early);
- ``compiled``: :class:`CompiledLM`, built on it (one compiled layer step over a static K/V cache);
- ``device_walk``: the compiled runtime's walk with every exit decided on the device;
- ``layer_math``: the elementwise layer math the compiled step and the device walk share, and the
  norm classes they support;
- ``build``: which runtime a config asks for (chosen above both, so the reference never imports
  the compiled runtime that extends it).
"""
