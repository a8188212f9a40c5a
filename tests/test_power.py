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
