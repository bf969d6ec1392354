"""NVML telemetry reads the GPU the worker runs on, not NVML's index 0.

No GPU here: `FakeNvml` stands in for the `pynvml` module with its own state (initialised or
not, per-device utilisation and memory), enumerating every GPU of a machine in NVML's order
as the real library does, whatever `CUDA_VISIBLE_DEVICES` says."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from workers.telemetry import NvmlSource, find_nvml_handle


@dataclass
class _Rates:
    gpu: int
    memory: int


@dataclass
class _Memory:
    total: int
    used: int
    free: int


@dataclass(frozen=True)
class _Handle:
    index: int


class FakeNvml:
    def __init__(self, uuids: list[str], memory_util: list[int], as_bytes: bool = False):
        self.uuids, self.memory_util, self.as_bytes = uuids, memory_util, as_bytes
        self.initialised = False
        self.num_handle_calls = 0

    def _check(self) -> None:
        if not self.initialised:
            raise RuntimeError("NVML_ERROR_UNINITIALIZED")

    def nvmlInit(self) -> None:
        self.initialised = True

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._check()
        if not 0 <= index < len(self.uuids):
            raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")
        self.num_handle_calls += 1
        return _Handle(index)

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str | bytes:
        self._check()
        uuid = self.uuids[handle.index]
        return uuid.encode() if self.as_bytes else uuid

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> _Rates:
        self._check()
        return _Rates(gpu=50, memory=self.memory_util[handle.index])

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> _Memory:
        self._check()
        used = (handle.index + 1) * 2**30
        return _Memory(total=80 * 2**30, used=used, free=80 * 2**30 - used)


UUIDS = ["GPU-0aaa1111-0000-0000-0000-000000000000",
         "GPU-1bbb2222-0000-0000-0000-000000000000",
         "GPU-2ccc3333-0000-0000-0000-000000000000",
         "GPU-3ddd4444-0000-0000-0000-000000000000"]


def _machine(as_bytes: bool = False) -> FakeNvml:
    return FakeNvml(UUIDS, memory_util=[10, 20, 30, 40], as_bytes=as_bytes)


@pytest.mark.parametrize("as_bytes", [False, True])
def test_torch_uuid_picks_that_gpu_not_index_0(as_bytes):
    # CUDA_VISIBLE_DEVICES=2: torch's cuda:0 is NVML's device 2; torch's UUID has no prefix.
    nvml = _machine(as_bytes)
    source = NvmlSource(0, torch_uuid="2ccc3333-0000-0000-0000-000000000000", nvml=nvml,
                        visible_devices="2")
    sample = source.sample(0, 0.01, now=1.0)
    assert sample.bandwidth_utilization == pytest.approx(0.30)
    assert sample.memory_used_bytes == 3 * 2**30
    assert source.uuid == "2ccc3333-0000-0000-0000-000000000000"


def test_uuid_wins_over_a_misleading_visible_list():
    nvml = _machine()
    nvml.nvmlInit()
    handle = find_nvml_handle(nvml, 1, torch_uuid=UUIDS[3], visible_devices="0,1")
    assert handle.index == 3


def test_unknown_uuid_is_an_error_not_a_wrong_gpu():
    nvml = _machine()
    nvml.nvmlInit()
    with pytest.raises(LookupError):
        find_nvml_handle(nvml, 0, torch_uuid="ffffffff-0000-0000-0000-000000000000",
                         visible_devices=None)


def test_without_uuid_the_visible_list_maps_torch_indices():
    nvml = _machine()
    nvml.nvmlInit()
    assert find_nvml_handle(nvml, 1, None, "3, 1").index == 1
    assert find_nvml_handle(nvml, 0, None, "3,1").index == 3
    # UUID entries, and the unique prefixes CUDA accepts.
    assert find_nvml_handle(nvml, 0, None, f"{UUIDS[2]}").index == 2
    assert find_nvml_handle(nvml, 1, None, "GPU-0aaa,GPU-1bbb").index == 1
    with pytest.raises(LookupError):
        find_nvml_handle(nvml, 2, None, "0,1")
    with pytest.raises(LookupError):
        find_nvml_handle(nvml, 0, None, "GPU-")  # ambiguous prefix


def test_without_uuid_or_visible_list_torch_index_is_nvml_index():
    nvml = _machine()
    nvml.nvmlInit()
    assert find_nvml_handle(nvml, 2, None, None).index == 2


def test_source_initialises_nvml_before_any_query():
    nvml = _machine()
    NvmlSource(1, torch_uuid=UUIDS[1], nvml=nvml, visible_devices=None)
    assert nvml.initialised and nvml.num_handle_calls >= 1
