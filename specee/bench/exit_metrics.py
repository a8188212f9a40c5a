"""What an early-exit mode's per-step traces say: where its time goes, how often it calls its
predictors and the LM head, and its exits against the oracle on its own tokens."""
from __future__ import annotations



def early_exit_metrics(gens, m: dict, split_gens=None, split_method: str | None = None) -> dict:
    """Where the early-exit modes spend their time, from the per-step traces. Counters come from
    the timed pass ``gens``; the phase split from ``split_gens`` (default: the same pass — right on
    a CPU; on CUDA a separate synchronized profiling pass)."""
    trace = [t for g in gens for t in g.trace]
    if not trace:
        return {}
    split_gens = split_gens if split_gens is not None else gens
    split = [t for g in split_gens for t in g.trace]
    split_decode_s = sum(g.decode_s for g in split_gens)
    phase = {k: sum(t.get(key, 0.0) for t in split) for k, key in (
        ("layers", "t_layers"), ("predictors", "t_pred"), ("verification", "t_verify"),
        ("draft", "t_draft"), ("other", "t_other"))}
    n = len(trace)
    # Tree modes trace one entry per verification step, which may emit several tokens.
    tokens = sum(t.get("emitted", 1) for t in trace)
    per_step = {}
    if any("emitted" in t for t in trace):
        per_step = {"verification_steps": n,
                    "predictor_calls_per_step": sum(t["pred_calls"] for t in trace) / n}
    measured = sum(phase.values()) > 0
    targets = [t["replay_target"] + 1 for t in trace if "replay_target" in t]
    verifies = sum(t["verify_calls"] for t in trace)
    if targets:  # what the replay asked for, beside what the schedule delivered (avg_layers)
        per_step["replay_target_avg_layers"] = sum(targets) / len(targets)
    return {
        **per_step,
        "predictor_calls_per_token": sum(t["pred_calls"] for t in trace) / tokens,
        "verify_calls_per_token": sum(t["verify_calls"] for t in trace) / tokens,
        "syncs_per_token": sum(t.get("syncs", 0) for t in trace) / tokens,
        # host round trips inside the layer walk (0 when the exits are decided on the device)
        "walk_syncs_per_token": (sum(t["walk_syncs"] for t in trace) / tokens
                                 if all("walk_syncs" in t for t in trace) else None),
        "exit_rate": sum(t["exit_layer"] < m["num_layers"] - 1 for t in trace) / n,
        # Of the steps where a predictor fired and the LM head verified, the share that exited
        # (replay forces its exits, so this is about real predictor decisions only).
        "fire_precision": (sum(t["exit_layer"] < m["num_layers"] - 1 for t in trace) / verifies)
        if verifies and not targets else None,
        "overhead_share": (phase["predictors"] + phase["verification"]) / split_decode_s if measured else None,
        "draft_share": phase["draft"] / split_decode_s if measured else None,
        "time_split_s": {**phase, "decode_total": split_decode_s},
        "time_split_method": split_method,
        # Phases are contiguous laps of each step, so they should account for (nearly) all of it.
        "time_split_coverage": sum(phase.values()) / split_decode_s if measured else None,
        "efficiency": m["speedup_vs_dense"] / (m["num_layers"] / m["avg_layers"]),
    }


def oracle_gap(rt, inputs, gens, n: int, verified: bool = True) -> dict:
    """Exits against the oracle on the mode's own tokens (the first ``n`` generations: one
    repeat), untimed, with an eager runtime over the same weights; plus the fires the LM-head
    verification refuted (each cost a full LM head and bought nothing)."""
    from specee.bench.oracle import exit_gap, own_oracle
    used, oracle, wrong = [], [], 0
    for ids, g in zip(inputs[:n], gens[:n]):
        first, differs = own_oracle(rt, ids, g.tokens)
        used += g.layers_run[1:len(first) + 1]
        oracle += first
        wrong += sum(differs)
    gap = exit_gap(used, oracle, rt.num_layers)
    if not gap:
        return {}
    trace = [t for g in gens for t in g.trace]
    tokens = sum(t.get("emitted", 1) for t in trace)
    exits = sum(t["exit_layer"] < rt.num_layers - 1 for t in trace)
    replayed = any("replay_target" in t for t in trace)  # replay forces exits: no real decisions
    refuted = sum(t["verify_calls"] for t in trace) - exits if verified and not replayed else None
    return {"oracle_gap": gap, "avg_layers_over_oracle": gap["avg_layers_over_oracle"],
            "oracle_avg_layers": gap["oracle_avg_layers"],
            "tokens_not_full_stack_prediction": wrong / max(1, len(used)),
            "refuted_fires_per_token": refuted / tokens if refuted is not None and tokens else None}
