"""The decoder a config asks for: its mode's spec builds it from the artifacts it needs
(:func:`specee.decoding.load_parts`), an ``auto`` setting chosen by :mod:`specee.tuning` (which
times decoders, so it sits above ``decoding/`` and is handed in here), and a frontier's certified
operating point applied where ``early_exit.operating_point`` names one."""
from __future__ import annotations

from specee import tuning
from specee.decoding import load_parts, modes, operating_point
from specee.decoding.hf_peer import build_peer as _build_hf_peer
from specee.errors import SpeceeError


def build_decoder(cfg, rt, placement=None, shadow: bool = False, profile_phases: bool = False,
                  eos_id: int | None = None):
    """The configured decoder, built by its mode's spec from the artifacts it needs.
    ``placement`` overrides cfg.placement (statistics compare several); ``shadow`` (modes whose
    spec allows it) records where the all-layers policy would have exited; ``profile_phases``
    makes CUDA phase reads synchronized (a profiling pass); ``eos_id``: the generation's EOS
    (prompt lookup cuts its proposals before one)."""
    spec = modes.of(cfg.ablation)
    if shadow and not (spec.shadow and not spec.is_tree(cfg.ablation)):
        raise SpeceeError(f"shadow exits are defined for autoregressive SpecEE only, not ablation={cfg.ablation.name}")
    parts = load_parts(cfg, rt, spec, placement)
    decoder = spec.build(cfg, rt, parts, shadow=shadow, eos_id=eos_id, tuning=tuning)
    decoder.profile_phases = profile_phases
    decoder.operating_point = None
    if cfg.early_exit.get("operating_point"):  # a frontier's certified point, run exactly
        operating_point.read(cfg).apply(decoder)
    return decoder


def build_peer(cfg, rt, mode: str, eos_id=None, num_tokens: int | None = None):
    """A transformers ``generate`` peer (specee/decoding/hf_peer.py)."""
    return _build_hf_peer(cfg, rt, mode, eos_id, num_tokens, tuning=tuning)
