"""--phase-timing: "sync" waits for a GPU at every phase boundary; "events" records an event there
and reads the device's times after the step, without ever waiting inside it. The device is faked:
its events carry the milliseconds at which the host recorded them, and the device reaches them
only when the test says so."""

import pytest
import torch

from deca_ds.runtime.allocated import DeviceMemory
from deca_ds.runtime.timing import DeviceTime, Timer


class Device:
    """A GPU's timeline: the host records events at `host_ms`; the device has run up to `reached_ms`."""

    host_ms = 0.0
    reached_ms = -1.0
    waits = 0  # event synchronizations (the host waiting for the device)


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing

    def record(self) -> None:
        self.at = Device.host_ms

    def query(self) -> bool:
        return Device.reached_ms >= self.at

    def synchronize(self) -> None:
        Device.waits += 1
        Device.reached_ms = max(Device.reached_ms, self.at)

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.query() and end.query(), "CUDA reads an event only once the device has passed it"
        return end.at - self.at


@pytest.fixture
def gpu(monkeypatch):
    Device.host_ms, Device.reached_ms, Device.waits = 0.0, -1.0, 0
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("events mode waited for the device"))
    for name in ("max_memory_allocated", "memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    return Timer(DeviceMemory(torch.device("cuda", 0)), "events")


def test_phase_times_are_read_after_the_step_without_waiting_inside_it(gpu):
    timer = gpu
    times = dict.fromkeys(("t_forward", "t_backward", "t_mix_update"), 0.0)
    t0 = timer.mark()
    for key, ms in zip(times, (5.0, 7.0, 2.5)):  # the device takes ms after the host's mark
        Device.host_ms += ms
        t1 = timer.mark(key.removeprefix("t_"))
        times[key] += t1 - t0
        t0 = t1
    assert Device.waits == 0 and all(isinstance(t, DeviceTime) for t in times.values())
    # the optimizer's parts, by the same clock: a difference of two device times
    update, combine = times["t_mix_update"], times["t_backward"]
    assert float(combine - update) == pytest.approx(4.5e-3) and float(1.0 - update) == pytest.approx(0.9975)
    assert {k: float(t) for k, t in times.items()} == pytest.approx(
        {"t_forward": 5e-3, "t_backward": 7e-3, "t_mix_update": 2.5e-3})
    assert Device.waits > 0  # reading waited for the last event, once the step was done


def test_a_running_total_reads_what_the_device_has_passed(gpu):
    """The mixer's exchange seconds over a run: each step's span is read once the device has passed
    it, so the total holds at most the spans still running, and ends exact."""
    timer, total = gpu, 0.0
    for step in range(100):
        start = timer.now()
        Device.host_ms += 3.0
        total += timer.now() - start
        Device.reached_ms = Device.host_ms - 3.0  # the device one span behind the host
        assert len(total.spans) <= 2, step
    assert float(total) == pytest.approx(0.3)


def test_sync_waits_at_every_mark_and_cpu_events_are_the_host_clock(monkeypatch):
    waits = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: waits.append(1))
    for name in ("max_memory_allocated", "memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    timer = Timer(DeviceMemory(torch.device("cuda", 0)))
    t0 = timer.mark()
    assert isinstance(timer.mark("forward") - t0, float) and len(waits) == 2
    cpu = Timer(DeviceMemory(torch.device("cpu")), "events")
    t0 = cpu.mark()
    lap = cpu.mark("forward") - t0
    assert isinstance(lap, DeviceTime) and float(lap) >= 0.0
    with pytest.raises(ValueError, match="phase timing must be one of"):
        Timer(DeviceMemory(torch.device("cpu")), "async")
