"""Eager dense loop against transformers' eager ``generate``: ms per decoded token, side by side.

    python scripts/bench_dense_loop.py                       # the committed tiny model
    python scripts/bench_dense_loop.py --prompt-tokens 512 --new-tokens 64 --rounds 5

Prints, per context length, the harness's dense loop (``DenseDecoder`` over ``LayerwiseLM``) and
``model.generate`` (greedy, DynamicCache) in ms per decoded token (decode only: for generate, a
call of N tokens less a call of one), their ratio, the aten ops each
dispatches per decoded token, and whether their tokens agree. Rounds alternate which side runs
first, and the median round is reported, so drift in the machine's speed does not favour one side;
on a shared machine the figures are still only as quiet as the machine (the script prints its
load average beside them). A benchmark to read, not a pass/fail test: the op-count bound is pinned
by tests/test_op_count.py.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from transformers import AutoModelForCausalLM

    from specee.bench.op_count import hf_forward_ops_per_token, loop_ops_per_token
    from specee.bench.speed import hf_generate
    from specee.decoding.dense import DenseDecoder
    from specee.runtime.layerwise import LayerwiseLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "specee" / "artifacts" / "tiny"))
    ap.add_argument("--prompt-tokens", default="16,256", help="comma-separated prompt lengths")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    dense = DenseDecoder(LayerwiseLM(model))
    vocab = model.config.vocab_size
    print(f"model {Path(args.model).name}, {model.config.num_hidden_layers} layers, torch {torch.__version__}, "
          f"{args.threads} thread(s), load average before {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    g = torch.Generator().manual_seed(0)
    for n in (int(x) for x in args.prompt_tokens.split(",")):
        ids = torch.randint(1, vocab, (1, n), generator=g)
        dense.generate(ids, 4, None)  # warm both sides
        hf_generate(model, ids, 4, None)
        d_ms, h_ms, same = [], [], True
        for r in range(args.rounds):
            for side in (("loop", "hf") if r % 2 == 0 else ("hf", "loop")):  # the harness's dense loop, HF generate
                if side == "loop":
                    gen = dense.generate(ids, args.new_tokens, None)
                    d_ms.append(1e3 * gen.decode_s / (len(gen.tokens) - 1))
                    d_tokens = gen.tokens
                else:  # decode only: a whole call less a one-token call (prefill and setup)
                    h_tokens, whole = hf_generate(model, ids, args.new_tokens, None)
                    _, first = hf_generate(model, ids, 1, None)
                    h_ms.append(1e3 * (whole - first) / (len(h_tokens) - 1))
            same = same and d_tokens == h_tokens
        d, h = statistics.median(d_ms), statistics.median(h_ms)
        print(f"prompt {n:5d} tokens: dense loop {d:7.3f} ms/token (decode only), HF generate {h:7.3f} ms/token "
              f"(decode only), ratio HF/dense {h / d:5.2f}x; aten ops per token: dense "
              f"{loop_ops_per_token(dense, ids):.0f}, HF forward {hf_forward_ops_per_token(model, ids):.0f}; "
              f"tokens identical: {same}")
    print(f"load average after {os.getloadavg()[0]:.2f}: figures from a shared machine are indicative only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
