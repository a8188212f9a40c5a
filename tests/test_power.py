import pytest
import torch

from specee.bench import power
from specee.bench.power import EnergyMeter


def test_cpu_without_rapl_reports_unavailable_with_a_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(power, "RAPL", tmp_path / "absent")
    meter = EnergyMeter.for_device("cpu")
    with meter.region():
        sum(range(1000))
    s = meter.summary(10)
    assert s == {"available": False, "reason": s["reason"]} and "RAPL" in s["reason"]


def test_rapl_counter_accumulates_across_wraparound(monkeypatch, tmp_path):
    zone = tmp_path / "intel-rapl:0"
    zone.mkdir()
    (zone / "max_energy_range_uj").write_text("1000000\n")
    (zone / "energy_uj").write_text("999000\n")
    monkeypatch.setattr(power, "RAPL", tmp_path)
    meter = EnergyMeter.for_device("cpu")
    assert meter.available
    with meter.region():
        (zone / "energy_uj").write_text("4000\n")  # wrapped: 1000 + 4000 uJ used
    s = meter.summary(5)
    assert s["source"] == "rapl" and s["joules"] == pytest.approx(0.005)
    assert s["joules_per_token"] == pytest.approx(0.001) and s["mean_watts"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the GPU-less path")
def test_gpu_meter_without_a_gpu_is_unavailable_not_a_crash():
    meter = EnergyMeter.for_device("cuda:0")
    assert not meter.available and meter.summary(1)["reason"]


def test_nvml_handle_follows_the_cuda_device_uuid_not_its_ordinal(monkeypatch):
    """Under CUDA_VISIBLE_DEVICES=3,1 CUDA ordinal 0 is NVML device 3: the meter must ask NVML for
    the device's UUID, never for index 0."""
    import sys
    import types
    calls = []
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByUUID=lambda u: calls.append(("uuid", u)) or f"h:{u}",
        nvmlDeviceGetHandleByIndex=lambda i: calls.append(("index", i)) or f"h:{i}",
        nvmlDeviceGetHandleByPciBusId=lambda b: calls.append(("bus", b)) or f"h:{b}",
        nvmlDeviceGetTotalEnergyConsumption=lambda h: 123456)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    props = types.SimpleNamespace(uuid="6f1e2d3c-aaaa-bbbb-cccc-000000000003", pci_bus_id=0x3B,
                                  pci_device_id=0, pci_domain_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    meter = power._NVML(0)
    assert calls == [("uuid", "GPU-6f1e2d3c-aaaa-bbbb-cccc-000000000003")]
    assert meter.matched_by == "uuid" and meter.energy_j() == pytest.approx(123.456)
    assert meter.power_w() is None  # no sampling thread beside the timed region
