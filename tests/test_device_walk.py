"""Exits decided on the device (runtime.exit_control=device): the same greedy tokens, exit layers and
counts as the host-branching walk, no host round trip inside the walk, and the CUDA-graph path
reached on the CPU up to the capture call."""
import contextlib

import pytest
import torch
from omegaconf import OmegaConf

from conftest import TINY

from specee.runtime.compiled import CompiledLM
from specee.decoding.specee_ar import SpecEEDecoder
from specee.early_exit.predictor import PredictorBank
from specee.early_exit.replayed_exits import load_replay
from specee.early_exit.schedule import build_schedule
from specee.errors import SpeceeError
from specee.models.draft import load_draft
from specee.runtime.layerwise import LayerwiseLM

ROOT = TINY.parent.parent.parent
PROMPT = torch.tensor([[1, 50, 60, 70, 80, 90, 100, 110]])


def _decoder(rt, kv_policy="holes", replay=None, delta_from="previous_layer"):
    draft, _ = load_draft(TINY.parent / "tiny_draft", rt)
    bank, _ = PredictorBank.load(TINY.parent / "tiny_predictors", rt.num_layers, 4, 0.5, "global")
    placement = OmegaConf.merge({"m": None, "coverage": None, "n_history": 5, "window": None,
                                 "reference_variant": False, "offline": False, "online": False},
                                OmegaConf.load(ROOT / "conf" / "placement" / "online_union.yaml"))
    schedule = build_schedule(placement, rt.num_layers, TINY.parent / "tiny_exit_profile")
    return SpecEEDecoder(rt, draft, bank, k=4, schedule=schedule, kv_policy=kv_policy, replay=replay,
                         delta_from=delta_from)


def _same(a, b):
    assert a.tokens == b.tokens and a.layers_run == b.layers_run
    for x, y in zip(a.trace, b.trace):
        for key in ("exit_layer", "pred_calls", "verify_calls", "delta_probes", "spec"):
            assert x[key] == y[key], key


@pytest.mark.parametrize("kv_policy", ["holes", "propagate"])
def test_device_exits_decode_as_the_host_walk_with_no_round_trip_inside_it(tiny, kv_policy):
    model, _ = tiny
    eager = _decoder(LayerwiseLM(model), kv_policy).generate(PROMPT, 20)
    host = _decoder(CompiledLM(model), kv_policy).generate(PROMPT, 20)
    device = _decoder(CompiledLM(model, exit_control="device"), kv_policy).generate(PROMPT, 20)
    _same(eager, host)
    _same(host, device)
    assert len(set(device.layers_run)) > 2  # exits at several depths, not only the full stack
    assert all(t["walk_syncs"] == 0 for t in device.trace)
    assert sum(t["walk_syncs"] for t in host.trace) >= sum(t["pred_calls"] for t in host.trace)
    # The host reads a device step's outcome once (token, exit layer, verifications, speculative ids).
    assert all(t["syncs"] == 1 for t in device.trace)


def test_a_replayed_exit_is_taken_on_the_device_where_the_host_takes_it(tiny):
    model, _ = tiny
    def replay():  # seeded draws from tiny's exit profile, the same for each side
        return load_replay(str(TINY.parent / "tiny_exit_profile"), 32, 0)
    host = _decoder(CompiledLM(model), replay=replay()).generate(PROMPT, 16)
    device = _decoder(CompiledLM(model, exit_control="device"), replay=replay()).generate(PROMPT, 16)
    _same(host, device)
    assert [t["replay_target"] for t in host.trace] == [t["replay_target"] for t in device.trace]


class _FakeGraph:
    """CUDA-graph stand-ins for a CPU: a capture runs its body (a real capture records it), a replay
    runs the recorded walk again into the captured outputs."""
    recorded = None

    def __init__(self):
        self.fn = None

    def replay(self):
        self.fn()


def test_the_cuda_graph_path_runs_on_the_cpu_up_to_the_capture_call(tiny, monkeypatch):
    """The graph path's own code (static inputs, warm-up on a side stream, capture under the
    conditional-node dispatch mode, replay, restored lengths) with CUDA's primitives faked, so a
    CUDA-only typo there fails here."""
    import specee.runtime.device_walk as dw
    from torch._higher_order_ops import cudagraph_conditional_nodes as cn
    model, _ = tiny
    host = _decoder(CompiledLM(model)).generate(PROMPT, 12)
    rt = CompiledLM(model, exit_control="device")
    dec = _decoder(rt)
    walker = dw.DeviceWalk(rt)
    walker.use_graph = True
    rt._device_walk = walker
    captured = []
    real_core = walker.core

    @contextlib.contextmanager
    def graph(g, *a, **k):
        # A capture records the walk; the fake records the call and runs it (lengths are restored
        # after it by the code under test, as after the real warm-up).
        captured.append(g)
        yield

    def core(x, cache, has, params):
        out = real_core(x, cache, has, params)
        if captured and captured[-1].fn is None:
            g = captured[-1]

            def again():
                for t, new in zip(out, real_core(x, cache, has, params)):
                    t.copy_(new)
            g.fn = again
        return out

    class _Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(walker, "core", core)
    monkeypatch.setattr(dw, "check_device_exits_supported", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(cn, "ControlFlowOpWarmupDispatchMode", contextlib.nullcontext)
    monkeypatch.setattr(cn, "CUDAGraphCaptureControlFlowOpDispatchMode", contextlib.nullcontext)
    device = dec.generate(PROMPT, 12)
    _same(host, device)
    assert walker.captures == 1 and len(walker.graphs) == 1  # captured once, replayed every step


def test_exit_control_device_is_refused_where_it_cannot_run():
    from specee.runtime.device_walk import check_device_exits_supported, conditional_nodes_problem
    from specee.launch import compose_and_check
    base = ["experiment=speed", "model=tiny", "ablation=specee_t1_t2"]
    compose_and_check([*base, "runtime=compiled", "runtime.exit_control=device"])
    with pytest.raises(SpeceeError, match="use runtime=compiled"):
        compose_and_check([*base, "runtime.exit_control=device"])
    with pytest.raises(SpeceeError, match="decodes a tree"):
        compose_and_check(["experiment=speed", "model=tiny", "ablation=specee_full", "runtime=compiled",
                           "runtime.exit_control=device"])
    with pytest.raises(SpeceeError, match="has none"):
        compose_and_check(["experiment=speed", "model=tiny", "ablation=adainfer", "runtime=compiled",
                           "runtime.exit_control=device"])
    assert conditional_nodes_problem("cpu") is None
    if not hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):  # this torch (a CPU build) has none
        assert "begin_capture_to_if_node" in conditional_nodes_problem("cuda")
        with pytest.raises(SpeceeError, match="use runtime.exit_control=host"):
            check_device_exits_supported("device", "cuda")


@pytest.mark.parametrize("runtime", ["eager", "compiled"])
def test_lookahead_reads_decode_as_the_host_walk_and_count_the_layers_they_waste(tiny, runtime):
    """runtime.exit_control=lookahead queues the next layer before reading a decision: the same
    tokens and exits as reading first (the wasted layer's cache entry is taken back), one wasted
    layer per exit taken at a layer with one above it."""
    model, _ = tiny

    def rt(control):
        r = CompiledLM(model) if runtime == "compiled" else LayerwiseLM(model)
        r.exit_control = control
        return r
    host = _decoder(rt("host")).generate(PROMPT, 20)
    ahead = _decoder(rt("lookahead")).generate(PROMPT, 20)
    _same(host, ahead)
    exits = sum(t["exit_layer"] < 31 for t in ahead.trace)
    assert exits > 0 and sum(t["wasted_layers"] for t in ahead.trace) == exits
    assert all("wasted_layers" not in t for t in host.trace)


def test_the_lookahead_read_takes_its_cuda_path_on_the_cpu(monkeypatch):
    """The pinned copy and the event of a lookahead read, with CUDA's primitives faked: a CUDA-only
    typo in that branch fails here."""
    from specee.decoding.base import PhaseTimer
    events = []

    class _Event:
        def record(self):
            events.append("record")

        def synchronize(self):
            events.append("synchronize")

    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    timer = PhaseTimer("cpu")
    handle = timer.start_read(torch.tensor(True), async_copy=True)
    assert events == ["record"] and timer.syncs == 0  # queued, not waited on
    assert timer.finish_read(handle) is True and events == ["record", "synchronize"] and timer.syncs == 1


def test_device_exits_read_the_authors_features_as_the_host_walk(tiny):
    """early_exit.delta_from=authors (p_prev zero before the first scheduled layer) on the device."""
    model, _ = tiny
    host = _decoder(CompiledLM(model), delta_from="authors").generate(PROMPT, 16)
    device = _decoder(CompiledLM(model, exit_control="device"), delta_from="authors").generate(PROMPT, 16)
    _same(host, device)
