"""specee\x27s Hydra launcher plugin (discovered by Hydra through the hydra_plugins namespace)."""
