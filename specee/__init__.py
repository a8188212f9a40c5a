"""specee: a reproducibility and benchmarking harness for Speculative Early Exiting (SpecEE)."""
__version__ = "0.1.0"
