"""The speed benchmark's GPU-facing steps, pinned on a CPU: warm-up at the timed capacity (HF
generate included), energy in long windows with the counter's updates counted, a busy check on
the GPU in use and the report's hardware label (the GPU check: tests/test_gpu_check.py)."""
import sys
import threading
import types

import pytest
import torch

from conftest import random_lm


def _speed():
    from specee.bench import timing as speed
    return speed


class FakeDecoder:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def generate(self, ids, max_new_tokens, eos=None, stop=None):
        toks = []
        while len(toks) < max_new_tokens and not (stop and stop(toks)):
            toks.append(1)
        self.log.append((self.name, max_new_tokens, len(toks)))
        return types.SimpleNamespace(tokens=toks)


def test_warm_up_sizes_caches_for_the_timed_run_and_warms_hf_generate():
    speed = _speed()
    log = []
    decs = (FakeDecoder("dense", log), FakeDecoder("mode", log), None)
    speed.warm_up(decs, ["p1", "p2"], 48, None, hf=lambda ids: log.append(("hf", ids)))
    assert log == [("dense", 48, 8), ("mode", 48, 8), ("hf", "p1"), ("dense", 48, 8), ("mode", 48, 8), ("hf", "p2")]


def test_warm_up_compiles_every_graph_the_timed_run_needs():
    """With cache_bucket the KV capacity is part of the graph: a warm-up with fewer new tokens
    than the timed run (the old min(8, n) budget) sized a smaller cache, and the timed run
    compiled. Warmed at the timed capacity, the timed run compiles nothing."""
    from specee.runtime.compiled import CompiledLM, compiled_graphs
    from specee.decoding.dense import DenseDecoder
    speed = _speed()
    dense = DenseDecoder(CompiledLM(random_lm("llama", layers=2), cache_bucket=16))
    ids = torch.randint(1, 100, (1, 9))
    speed.warm_up([dense], [ids], 40, None)
    before = compiled_graphs()
    dense.generate(ids, 40)
    assert compiled_graphs() == before
    dense.generate(ids, 8)  # capacity 17 -> another bucket (32 vs 64): what the old warm-up left
    assert compiled_graphs() > before


def test_warm_key_follows_cache_buckets_only():
    speed = _speed()
    rt = types.SimpleNamespace(kind="compiled", cache_bucket=64)
    assert speed.warm_key(rt, 30) == 30
    assert speed.warm_key(types.SimpleNamespace(kind="compiled", cache_bucket=0), 30) is None
    assert speed.warm_key(types.SimpleNamespace(kind="eager"), 30) is None


class CountingBackend:
    """An energy counter that advances on every read (as if it updated between polls)."""
    source = "fake"
    poll_s = 0.001

    def __init__(self, polls_needed=0):
        self.reads, self.polled = 0, threading.Event()
        self.polls_needed = polls_needed

    def energy_j(self):
        self.reads += 1
        if self.reads >= self.polls_needed:
            self.polled.set()
        return float(self.reads)

    def power_w(self):
        return None


def test_energy_pass_gives_each_side_one_window_over_all_prompts_in_alternating_order():
    from specee.bench.power import EnergyMeter
    speed = _speed()
    log = []
    sides = {"dense": FakeDecoder("dense", log), "mode": FakeDecoder("mode", log), "eager_dense": None}
    meters = {k: EnergyMeter(CountingBackend()) for k in sides}
    tokens = speed.energy_pass(sides, meters, ["a", "b", "c"], 5, None, rounds=2)
    assert tokens == {"dense": 30, "mode": 30}
    assert [n for n, _, _ in log] == ["dense"] * 3 + ["mode"] * 3 + ["mode"] * 3 + ["dense"] * 3
    assert meters["dense"].windows == meters["mode"].windows == 2 and meters["eager_dense"].windows == 0


def test_energy_windows_count_the_counters_updates_and_say_when_quantised():
    from specee.bench.power import EnergyMeter
    backend = CountingBackend(polls_needed=15)
    meter = EnergyMeter(backend)
    with meter.region():
        assert backend.polled.wait(10)  # the poller has read the counter 15 times
    s = meter.summary(4)
    assert s["windows"] == 1 and s["counter_updates"] >= 13 and s["min_counter_updates_per_window"] >= 13
    assert "quantised" not in s
    few = EnergyMeter(CountingBackend())
    few.backend.poll_s = 60  # no poll inside the window: start and end only
    with few.region():
        pass
    s = few.summary(4)
    assert s["counter_updates"] == 1 and "quantised" in s


def test_busy_check_reads_the_gpu_in_use_after_leaving_it_idle(monkeypatch):
    """NVML index 0 is not CUDA device 0 under CUDA_VISIBLE_DEVICES, another GPU's load is not
    ours, and NVML's utilisation covers its last sample period: sync, stay idle that long, then
    read the device matched by UUID."""
    from specee import env
    events = []
    util = {"h:GPU-mine": 3, "h:other": 100}
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByUUID=lambda u: f"h:{u}",
        nvmlDeviceGetHandleByIndex=lambda i: pytest.fail("NVML device looked up by CUDA ordinal"),
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetUtilizationRates=lambda h: events.append(("read", h)) or types.SimpleNamespace(gpu=util[h]))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: events.append(("sync", d)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid="mine"))
    monkeypatch.setattr(env.time, "perf_counter", lambda: 0.0)  # no time passes but what it sleeps
    monkeypatch.setattr(env.time, "sleep", lambda s: events.append(("sleep", s)))
    out = env.machine_load(sample_s=0.5, device="cuda:1")
    assert events[0] == ("sync", torch.device("cuda:1"))
    slept = sum(s for kind, s in events if kind == "sleep")
    assert slept >= env.GPU_IDLE_S and events[-1] == ("read", "h:GPU-mine")
    assert out["gpu_utilization_pct"] == [3]  # the other GPU's 100% is not this run's business
    events.clear()
    env.machine_load(sample_s=0.0, device="cpu")
    assert not any(kind == "read" for kind, _ in events)


@pytest.mark.parametrize("device,label", [("cpu", "CPU"), ("cuda:1", "B"), ("cuda", "A")])
def test_report_labels_a_run_with_the_device_it_ran_on(device, label):
    from specee.report_pages.catalogue import hardware as _hardware
    doc = {"device": device, "config": {"model": {"device": device}},
           "env": {"gpus": [{"index": 0, "name": "A"}, {"index": 1, "name": "B"}], "cpu": "x", "torch_threads": 2}}
    assert _hardware(doc).startswith(label)
