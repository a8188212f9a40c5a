"""Where the exit is decided, timed side by side: autoregressive SpecEE (T1+T2: the trained bank,
online-union placement) on `tiny` with runtime.exit_control = host, lookahead and device, on the
eager and compiled runtimes, interleaved over rounds; ms/token (median and range over rounds),
host round trips inside the walk, and whether the tokens equal the host walk's.

    python scripts/bench_exit_control.py [--rounds 5] [--tokens 24]

On a CPU the device walk runs each ``torch.cond`` eagerly (it traces its branches), so it is far
slower than the host branch: this prints the cost of the semantics here, not the GPU path (one
CUDA graph with conditional nodes). Quiet machine only: other work on the cores is noise.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def decoder(rt):
    from omegaconf import OmegaConf
    from specee.decoding.specee_ar import SpecEEDecoder
    from specee.early_exit.predictor import PredictorBank
    from specee.early_exit.schedule import build_schedule
    from specee.models.draft import load_draft
    art = ROOT / "specee" / "artifacts"
    draft, _ = load_draft(art / "tiny_draft", rt)
    bank, _ = PredictorBank.load(art / "tiny_predictors", rt.num_layers, 4, 0.5, "global")
    placement = OmegaConf.merge({"m": None, "coverage": None, "n_history": 5, "window": None,
                                 "reference_variant": False, "offline": False, "online": False},
                                OmegaConf.load(ROOT / "conf" / "placement" / "online_union.yaml"))
    return SpecEEDecoder(rt, draft, bank, k=4, schedule=build_schedule(placement, rt.num_layers,
                                                                       art / "tiny_exit_profile"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM
    from specee.runtime.compiled import CompiledLM
    from specee.runtime.layerwise import LayerwiseLM
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(ROOT / "specee" / "artifacts" / "tiny", dtype=torch.float32).eval()
    prompt = torch.tensor([[1, 50, 60, 70, 80, 90, 100, 110]])
    sides = {}
    for kind in ("eager", "compiled"):
        for control in ("host", "lookahead", "device"):
            if kind == "eager" and control == "device":
                continue  # the device walk needs the compiled runtime's static cache
            rt = CompiledLM(model, exit_control=control) if kind == "compiled" else LayerwiseLM(model)
            rt.exit_control = control
            sides[f"{kind}/{control}"] = decoder(rt)
    ref = None
    times = {k: [] for k in sides}
    out = {}
    for name, dec in sides.items():  # warm-up: compiles, traces every torch.cond branch
        out[name] = dec.generate(prompt, args.tokens)
    ref = out["eager/host"].tokens
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for name in order:
            t0 = time.perf_counter()
            gen = sides[name].generate(prompt, args.tokens)
            times[name].append((time.perf_counter() - t0) * 1e3 / len(gen.tokens))
            out[name] = gen
    print(f"tiny, T1+T2 (online union), {args.tokens} tokens, {args.rounds} interleaved rounds, "
          f"{torch.get_num_threads()} threads, {torch.__version__}")
    print(f"{'side':<22}{'ms/token (median)':>18}{'range':>20}{'walk syncs/token':>18}{'tokens = host':>15}")
    for name, ts in times.items():
        gen = out[name]
        walk = sum(t["walk_syncs"] for t in gen.trace) / max(len(gen.trace), 1)
        print(f"{name:<22}{statistics.median(ts):>18.2f}{f'[{min(ts):.2f}, {max(ts):.2f}]':>20}{walk:>18.2f}"
              f"{str(gen.tokens == ref):>15}")


if __name__ == "__main__":
    main()
