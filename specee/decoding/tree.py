"""Tree speculative decoding (EAGLE-1 static tree), optionally with SpecEE early exit (paper §6).

One verification step, from the root r (the last emitted token, not yet in the base cache) and
f, the base feature of the token before it:

1. draft: the draft head reads the newly accepted pairs and (r, f), then expands the static tree
   level by level (children of a node = its draft top-ranked tokens, each child reads its parent's
   draft feature), over its own cache with a tree mask; the tree entries are cropped afterwards,
   and the next step re-feeds the accepted tokens with their *base* features (EAGLE-1's rule).
2. verify: one base forward over [r] + tree nodes, each node at position seq_len + depth and
   attending to the cache plus its tree ancestors and itself (``block_mask``).
3. accept (greedy): walk from r following the base prediction; the accepted nodes' tokens and the
   prediction at the last accepted node (the bonus) are emitted; only the walk's K/V is kept.

Without predictors this is lossless: token-identical to dense greedy.

Early exit (``predictors`` given). A unit is one predictor evaluation per active layer; its
feature node v gives spec_features(norm(h_l[v]), S(v)) with S(v) the draft's top-K at v (v's
tree children are its top ranks). The paper's two mappings (§6, Fig. 13):

- ``independent``: a unit per node that has children (the root always), deciding among its
  candidates; leaves get no predictor and no speculative set;
- ``merged``: a unit per root-to-leaf path (a hyper-token), read at the leaf, whose hidden state
  has attended to the whole path; leaves are drafted one level further for their S.

Per verification step the schedule's active set is read once and the step's exit layer recorded
once. When some unit fires at layer l < L-1, the LM head runs once over all nodes (one
verification) and the layer-l walk W_l is taken with the layer-l predictions. The step exits at l
iff every node of W_l verifies (its layer-l prediction, i.e. the accepted child or the bonus, is
in S(v), as in autoregressive SpecEE) and the units W_l needs fired: independent, the units of
W_l's nodes (a walk ending at a leaf has no predictor for its bonus and cannot exit); merged, the
hyper-tokens through W_l's last node, i.e. every path containing the whole accepted prefix,
including paths whose later nodes W_l rejected. Paths that leave W_l earlier were rejected at
this layer: their outputs are ignored and never block an exit. Otherwise the walk at the last
layer is taken (dense verification). All nodes stop at the same layer e; the kept (walk) nodes'
K/V of layers > e are left or filled from h_e by ``kv_policy``
(:func:`~specee.early_exit.kv_policy.fill_skipped`), and their features norm(h_e) feed the draft.

Consistency with :class:`~specee.decoding.specee_ar.SpecEEDecoder`: with the root alone (tree
``[]``, ``chain(0)``) both mappings are exactly the autoregressive mode: same S, features, p_prev,
verification, exit layer, K/V policy and schedule bookkeeping. With one drafted node (``[[0]]``)
outputs can differ once exits happen: AR decides the second token's exit on its own, after the
first token's skipped layers became holes, while one forward gives both tokens one exit layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specee.decoding.base import Generation, LoopDecoder, PhaseTimer, Step
from specee.decoding.tree_shape import build, independent_units
from specee.early_exit.features import delta_probe_layers, initial_p, spec_features
from specee.early_exit.kv_policy import check_policy, fill_skipped
from specee.early_exit.schedule import AllLayers
from specee.errors import SpeceeError
from specee.runtime.layerwise import LayerKVCache, LayerwiseLM

MAPPINGS = ("independent", "merged")
EXIT_RULES = ("all_paths", "any_path")  # merged: every hyper-token through the walk's end fires, or one


@dataclass
class TreeSession:
    cache: LayerKVCache
    dcache: object
    state: object  # the schedule's per-request state
    root: int  # the last emitted token, not yet in the base cache
    pend_ids: torch.Tensor  # accepted tokens the draft has not read yet (ending with the root)
    pend_feats: torch.Tensor  # their base features
    replay: object = None  # the exit replay's per-request state


class TreeDecoder(LoopDecoder):
    name = "tree"
    multi_token = True

    def __init__(self, rt: LayerwiseLM, draft, tree="small", *, bank=None, schedule=None,
                 mapping: str | None = None, k: int = 4, kv_policy: str = "holes", replay=None,
                 delta_from: str = "previous_layer", exit_rule: str = "all_paths"):
        self.rt, self.draft, self.predictors, self.k = rt, draft, bank, k
        self.delta_from = delta_from  # where p_prev comes from (features.delta_probe_layers)
        if exit_rule not in EXIT_RULES:
            raise SpeceeError(f"tree exit rule {exit_rule!r} is unknown; valid: {', '.join(EXIT_RULES)}")
        self.exit_rule = exit_rule  # merged: all / one of the hyper-tokens through the walk's end
        # merged: an exit verification computes head rows only for nodes on fired hyper-tokens
        # (decides exactly as the whole tree's head; False computes every row, the reference)
        self.fired_rows_only = True
        self.replay = replay  # ExitReplay (with predictors): the step exits where it says
        self.tree = build(tree)
        self.kv_policy = check_policy(kv_policy)
        self.schedule = schedule or AllLayers(rt.num_layers)
        self.mapping = mapping or "merged"
        if self.mapping not in MAPPINGS:
            raise SpeceeError(f"mapping={mapping!r} is unknown; valid: {', '.join(MAPPINGS)}")
        has = bank.has.tolist() if bank is not None else [False] * rt.num_layers
        self.can_exit = [bool(has[i]) and i < rt.num_layers - 1 for i in range(rt.num_layers)]
        tr = self.tree
        if self.mapping == "independent":
            self.units = [[v] for v in independent_units(tr)]
            self.unit_of = {u[0]: j for j, u in enumerate(self.units)}
        else:
            self.units = tr.root_paths
            self.through = [[u for u, p in enumerate(self.units) if v in p] for v in range(tr.size)]
        self.feat_node = [u[-1] for u in self.units]
        self.spec_nodes = set(self.feat_node)  # nodes that need a speculative set (draft top-K)
        self._device_buffers()

    def _device_buffers(self) -> None:
        """Masks, depths and the draft's per-level masks depend only on the tree's shape: built
        once, on the runtime's device, not per step on the CPU."""
        tr, dev = self.tree, self.rt.device
        self.block = tr.mask.to(dev) if tr.size > 1 else None  # root alone: AR's exact call
        self.feat_idx = torch.tensor(self.feat_node, device=dev)
        self.depth = torch.tensor(tr.depth, device=dev)
        spec_on = self.predictors is not None
        self.draft_levels, fed = [], []
        for depth in range(tr.max_depth + 1):
            level = [v for v in tr.level(depth) if tr.children[v] or (spec_on and v in self.spec_nodes)]
            if not level:
                continue
            allowed = tr.mask[level][:, fed + level].to(dev) if depth else None
            if depth:
                fed += level
            width = max([self.k if spec_on else 0] + [tr.rank[c] + 1 for v in level for c in tr.children[v]])
            self.draft_levels.append((depth, level, allowed, width))

    def needed(self, walk: list[int]) -> set[int] | None:
        """The units that must fire for the layer-l walk to exit; None: it cannot exit.

        independent: the predictor of every walk node (each vouches that its accepted child,
        or for the last node the bonus, is among its candidates); a walk ending at a leaf has no
        predictor for its bonus token, so it cannot exit. merged: the hyper-tokens through the
        walk's last node -- every path that contains the whole accepted prefix."""
        if self.mapping == "independent":
            if walk[-1] not in self.unit_of:
                return None
            return {self.unit_of[v] for v in walk}
        return set(self.through[walk[-1]])

    # -- draft ----------------------------------------------------------------------------
    @torch.inference_mode()
    def draft_tree(self, root: int, pend_ids, pend_feats, dcache, timer: PhaseTimer):
        """Feed the pending (token, base feature) pairs ending with the root, expand the tree.

        Returns node tokens and, with predictors, S(v) per node (else None)."""
        tr, d, rt = self.tree, self.draft, self.rt
        spec_on = self.predictors is not None
        f_hat = {0: d(pend_ids, pend_feats, dcache)[0, -1]}
        base = dcache.lengths[0]  # history + root: visible to every tree node
        tokens, spec = [root] + [0] * (tr.size - 1), [None] * tr.size
        for depth, level, allowed, width in self.draft_levels:
            if depth:
                pos = torch.full((1, len(level)), base - 1 + depth, device=rt.device)
                out = d(timer.to_device([[tokens[v] for v in level]]),
                        torch.stack([f_hat[tr.parent[v]] for v in level])[None], dcache, pos,
                        rt._additive_mask(base, len(level), allowed))
                f_hat.update({v: out[0, j] for j, v in enumerate(level)})
            top = timer.host_list(d.topk(torch.stack([f_hat[v] for v in level]), width))
            for v, t in zip(level, top):
                for c in tr.children[v]:
                    tokens[c] = t[tr.rank[c]]
                spec[v] = t[: self.k] if spec_on else None
        dcache.crop(base)
        return tokens, spec if spec_on else None

    # -- verify ---------------------------------------------------------------------------
    @torch.inference_mode()
    def verify(self, tokens, spec, cache, state, timer: PhaseTimer, target=None):
        """One base forward over the tree; returns (walk, predictions, features of the walk, exit, trace)."""
        rt, tr, pred = self.rt, self.tree, self.predictors
        ids = timer.to_device([tokens])
        pos = (cache.seq_len + self.depth)[None]
        start = list(cache.lengths)
        h = rt.embed(ids)
        rope = rt.rope(h, pos, cache.seq_len + tr.max_depth)
        active = self.schedule.active(state)
        eligible = [self.can_exit[i] and active[i] for i in range(rt.num_layers)]
        probe_only = delta_probe_layers(eligible, self.delta_from) if spec is not None else [False] * len(eligible)
        p_prev = {}
        if spec is not None:  # (units, K, d): the LM-head rows of each unit's candidates
            spec_w = rt.lm_head.weight[timer.to_device([spec[v] for v in self.feat_node])]
            p_prev = [initial_p(self.k, spec_w[j], self.delta_from) for j in range(len(self.feat_node))]
        counts = {"pred_calls": 0, "verify_calls": 0, "delta_probes": 0, "head_rows": 0}

        def exit_test(i, h):
            normed = rt.norm(h)[0]
            if probe_only[i]:  # layer l-1's p for the predictors at l, as in training
                z = (spec_w @ normed[self.feat_idx][..., None])[..., 0].float()
                p_prev[:] = list(torch.softmax(z, -1))
                counts["delta_probes"] += 1
                timer.lap("predictors")
                return None
            decisions = []
            for j, v in enumerate(self.feat_node):
                x, p_prev[j] = spec_features(normed[v], spec_w[j], p_prev[j])
                decisions.append(pred.decide(i, x))
            fires = timer.host_list(torch.stack(decisions))  # one sync per layer, not per unit
            counts["pred_calls"] += len(fires)
            timer.lap("predictors")
            if target is not None:  # replay: exit here iff the target is reached
                fires = [i >= target] * len(fires)
            if not any(fires):
                return None
            counts["verify_calls"] += 1
            if self.mapping == "merged" and target is None and self.fired_rows_only:
                # Only nodes on a fired hyper-token can end an exit: a walk that steps onto a node no
                # fired path contains exits through no fired path, so it is refused whatever that
                # node's row would say. One head call over those rows, the rest never computed.
                rows = sorted({v for u, f in zip(self.units, fires) if f for v in u})
                got = timer.host_list(rt.lm_head(normed[timer.to_device(rows)]).argmax(-1))
                nxt = [-1] * tr.size  # -1: not computed, matches no child and lies in no S(v)
                for v, t in zip(rows, got):
                    nxt[v] = t
                counts["head_rows"] += len(rows)
            else:
                nxt = timer.host_list(rt.lm_head(normed).argmax(-1))
                counts["head_rows"] += tr.size
            walk = tr.walk(nxt, tokens)
            needed = self.needed(walk)
            agree = any if self.mapping == "merged" and self.exit_rule == "any_path" else all
            ok = target is not None or (needed is not None and agree(fires[u] for u in needed)
                                        and all(nxt[v] in spec[v] for v in walk))
            timer.lap("verification")
            return (walk, nxt, normed) if ok else None

        walk_at = [e or p for e, p in zip(eligible, probe_only)]
        exit_layer, h, decision = rt.walk(h, rope, cache, pos, self.block, walk_at, exit_test, timer)
        if decision is None:
            normed = rt.norm(h)[0]
            nxt = timer.host_list(rt.lm_head(normed).argmax(-1))
            walk = tr.walk(nxt, tokens)
            timer.lap("layers")
        else:
            walk, nxt, normed = decision
        idx = timer.to_device(walk)
        for j in range(exit_layer + 1):  # layers above the exit got no entries this step
            cache.keep(j, start[j], idx)
        cache.seq_len += len(walk)
        fill_skipped(rt, cache, h[:, idx], exit_layer, (rope[0][:, idx], rope[1][:, idx]), self.kv_policy)
        timer.lap("layers")
        self.schedule.record(state, exit_layer)
        trace = {"exit_layer": exit_layer, "layers": exit_layer + 1, "nodes": tr.size,
                 "accepted": len(walk), "walk_ranks": [tr.rank[v] for v in walk[1:]], **counts}
        return walk, nxt, normed[idx], exit_layer, trace

    # -- loop -----------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompt_ids, max_new_tokens: int):
        rt = self.rt
        extra = self.tree.max_depth + 2
        n = prompt_ids.shape[1] + max_new_tokens + self.tree.size + extra
        cache, dcache = rt.new_cache(n), self.draft.new_cache(n)
        f = rt.norm(rt.forward(prompt_ids, cache))
        if prompt_ids.shape[1] > 1:  # the draft's history: pairs (x[i+1], f[i])
            self.draft(prompt_ids[:, 1:], f[:, :-1], dcache)
        root_t = rt.lm_head(f[:, -1])[0].argmax()
        s = TreeSession(cache, dcache, self.schedule.new_request(), int(root_t), root_t.view(1, 1), f[:, -1:],
                        self.replay.new_request(prompt_ids) if self.replay else None)
        return s, s.root

    @torch.inference_mode()
    def step(self, s: TreeSession) -> Step:
        timer = self.timer()
        timer.start()
        nodes, spec = self.draft_tree(s.root, s.pend_ids, s.pend_feats, s.dcache, timer)
        timer.lap("draft")
        target = self.replay.target(s.replay) if self.replay and self.predictors is not None else None
        walk, nxt, feats, exit_layer, trace = self.verify(nodes, spec, s.cache, s.state, timer, target)
        if target is not None:
            trace["replay_target"] = target
        new = [nodes[v] for v in walk[1:]] + [nxt[walk[-1]]]
        s.root = new[-1]
        s.pend_ids, s.pend_feats = timer.to_device([new]), feats[None]
        timer.lap("other")
        return Step(new, exit_layer, trace | timer.trace())

    def score(self, context_ids, continuation: list[int], exit_at_context_end: bool = True):
        """Teacher forcing: the lossless tree scores as dense; tree early exit has no scoring rule yet."""
        if self.predictors is not None:
            raise SpeceeError("scoring (accuracy tasks) is not defined for tree decoding with early "
                              "exit; use the autoregressive SpecEE mode for accuracy")
        from specee.decoding.dense import DenseDecoder
        return DenseDecoder(self.rt).score(context_ids, continuation, exit_at_context_end)


def mean_accepted_length(gens: list[Generation]) -> float:
    """Tokens a verification step accepts, bonus included (EAGLE's tau), over all steps."""
    steps = [t["accepted"] for g in gens for t in g.trace]
    return sum(steps) / len(steps) if steps else float("nan")
