"""`ReplanGate`: a wrapper's plan rewrites its page-locked schedule only once the device copy of
its previous plan has run; planning another wrapper does not wait for it. The copies are
simulated: a plan "queues" the copy of its host buffer, and a marker's `synchronize` runs the
copies queued up to it, as the GPU reaching an event would."""

from __future__ import annotations

from workers.attention.replan_gate import ReplanGate


class Device:
    """Copies queued in stream order; `run_until(n)` runs the first n."""

    def __init__(self) -> None:
        self.queued: list[tuple[FakeWrapper, int]] = []  # (wrapper, index of its plan)
        self.ran = 0

    def run_until(self, n: int) -> None:
        for wrapper, _ in self.queued[self.ran : n]:
            wrapper.on_device = list(wrapper.pinned)  # reads the host buffer as it is now
        self.ran = max(self.ran, n)


class FakeWrapper:
    """FlashInfer's plan: the schedule into one pinned buffer, its copy queued, no wait."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.pinned: list[int] = []
        self.on_device: list[int] = []

    def plan(self, *schedule: int) -> None:
        self.pinned[:] = schedule
        self.device.queued.append((self, len(self.device.queued)))


class Marker:
    def __init__(self, device: Device) -> None:
        self.device, self.at = device, len(device.queued)
        self.waited = False

    def synchronize(self) -> None:
        self.waited = True
        self.device.run_until(self.at)


def test_a_replan_waits_for_the_copy_of_the_plan_before() -> None:
    device = Device()
    markers: list[Marker] = []

    def record() -> Marker:
        markers.append(Marker(device))
        return markers[-1]

    gate, prefill = ReplanGate(record), FakeWrapper(device)
    gate.plan(prefill, 1, 2, 3)  # step n: its copy waits behind the GPU's backlog
    gate.plan(prefill, 7, 8)  # step n+1, planned before the GPU got there
    assert markers[0].waited
    device.run_until(1)  # the GPU reaches step n's copy now, and nothing later
    assert prefill.on_device == [1, 2, 3]  # step n's own schedule, not step n+1's


def test_another_wrapper_plans_without_waiting() -> None:
    device = Device()
    markers: list[Marker] = []

    def record() -> Marker:
        markers.append(Marker(device))
        return markers[-1]

    gate = ReplanGate(record)
    decode, prefill = FakeWrapper(device), FakeWrapper(device)
    gate.plan(decode, 1)
    gate.plan(prefill, 2)  # its own buffer: the decode's pending copy is not in its way
    assert not markers[0].waited
    gate.plan(decode, 3)
    assert markers[0].waited and not markers[1].waited
