"""Per-worker telemetry: memory-bandwidth utilisation samples for flow control.

Pluggable sources, all answering `sample(bytes_moved, elapsed_s, now) -> TelemetrySample`
once per step:
- `NvmlSource`: NVIDIA GPUs through `nvidia-ml-py` (memory-controller utilisation and
  memory used, as `nvidia-smi` reports them) of the GPU the worker runs on, found by the
  torch device's UUID (NVML's indices ignore `CUDA_VISIBLE_DEVICES`);
- `CpuEstimateSource`: no counter to read, so an estimate: the bytes the step moved
  (weights, KV read and written, activations; the worker computes them) over the step
  time, relative to the measured peak bandwidth;
- `ScriptedSource`: values from a script (tests, chaos runs: telemetry spikes).
The 5-second moving average that the modes use lives in flow control, not here: a
source reports what it sees now.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TelemetrySample:
    time_s: float
    bandwidth_utilization: float  # 0..1 of the device's peak memory bandwidth
    memory_used_bytes: int | None = None
    source: str = ""


class CpuEstimateSource:
    def __init__(self, peak_bandwidth_bytes_s: float):
        if peak_bandwidth_bytes_s <= 0:
            raise ValueError("peak bandwidth must be positive")
        self.peak = peak_bandwidth_bytes_s

    def sample(self, bytes_moved: int, elapsed_s: float, now: float) -> TelemetrySample:
        util = bytes_moved / elapsed_s / self.peak if elapsed_s > 0 else 0.0
        return TelemetrySample(now, min(max(util, 0.0), 1.0), None, "cpu-estimate")


def _normalise_uuid(uuid: str | bytes) -> str:
    """NVML says "GPU-<hex>" (bytes in old bindings), torch the bare "<hex>"."""
    text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    text = text.strip().lower()
    for prefix in ("gpu-", "mig-"):
        text = text.removeprefix(prefix)
    return text


def find_nvml_handle(nvml: Any, device_index: int, torch_uuid: str | None,
                     visible_devices: str | None) -> Any:
    """The NVML handle of the GPU torch calls `cuda:<device_index>`.

    NVML numbers every GPU of the machine, torch only the visible ones, so index i is the
    same GPU only without `CUDA_VISIBLE_DEVICES`. In order of trust: torch's UUID for the
    device; else the i-th `CUDA_VISIBLE_DEVICES` entry (a UUID prefix, as CUDA accepts, or a
    machine index); else NVML index i. LookupError when nothing matches."""
    if torch_uuid:
        want = _normalise_uuid(torch_uuid)
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            if _normalise_uuid(nvml.nvmlDeviceGetUUID(handle)) == want:
                return handle
        raise LookupError(f"no NVML device has the UUID {torch_uuid}")
    if visible_devices:
        entries = [e.strip() for e in visible_devices.split(",") if e.strip()]
        if device_index >= len(entries):
            raise LookupError(f"cuda:{device_index} is not in CUDA_VISIBLE_DEVICES")
        entry = entries[device_index]
        if entry.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(entry))
        want = _normalise_uuid(entry)
        matches = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            if _normalise_uuid(nvml.nvmlDeviceGetUUID(handle)).startswith(want):
                matches.append(handle)
        if len(matches) != 1:
            raise LookupError(f"CUDA_VISIBLE_DEVICES entry {entry!r} matches "
                              f"{len(matches)} NVML devices")
        return matches[0]
    return nvml.nvmlDeviceGetHandleByIndex(device_index)


class NvmlSource:
    def __init__(self, device_index: int = 0, torch_uuid: str | None = None,
                 nvml: Any = None, visible_devices: str | None = None):
        """`nvml`: the `pynvml` module (from nvidia-ml-py; imported only where a GPU is
        present) or a stand-in. `visible_devices` defaults to `CUDA_VISIBLE_DEVICES`."""
        if nvml is None:
            import pynvml as nvml
        if visible_devices is None:
            visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        nvml.nvmlInit()
        self._nvml = nvml
        self._handle = find_nvml_handle(nvml, device_index, torch_uuid, visible_devices)
        self.uuid = _normalise_uuid(nvml.nvmlDeviceGetUUID(self._handle))

    def sample(self, bytes_moved: int, elapsed_s: float, now: float) -> TelemetrySample:
        rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
        memory = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        return TelemetrySample(now, rates.memory / 100.0, int(memory.used), "nvml")


class ScriptedSource:
    """Utilisation from a function of time, or a list replayed one value per sample."""

    def __init__(self, script: Callable[[float], float] | Sequence[float]):
        self._script = script
        self._index = 0

    def sample(self, bytes_moved: int, elapsed_s: float, now: float) -> TelemetrySample:
        if callable(self._script):
            value = self._script(now)
        else:
            value = self._script[min(self._index, len(self._script) - 1)]
            self._index += 1
        return TelemetrySample(now, float(value), None, "scripted")


TelemetrySource = CpuEstimateSource | NvmlSource | ScriptedSource


_device_to_peak: dict[str, float] = {}  # measured once per process and device


def _torch_device_identity(device: str) -> tuple[int, str | None]:
    """(torch's index, its UUID) of a `cuda[:i]` device; the UUID is None where torch
    does not expose it."""
    import torch

    index = torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return index, (str(uuid) if uuid is not None else None)


def make_source(device: str, peak_bandwidth_bytes_s: float | None) -> TelemetrySource:
    """NVML on CUDA devices when it initialises; the CPU estimate otherwise, against the
    given peak or one measured here (a short copy probe, once per process)."""
    if device.startswith("cuda"):
        try:
            return NvmlSource(*_torch_device_identity(device))
        except Exception as err:  # no driver library, no permission: estimate instead
            logger.warning("NVML unavailable (%s); using the bandwidth estimate", err)
    if peak_bandwidth_bytes_s is None:
        if device not in _device_to_peak:
            from workers.hardware import measure_memory_bandwidth

            _device_to_peak[device] = measure_memory_bandwidth(
                nbytes=64 * 2**20, warmup=1, iters=3, device=device)
        peak_bandwidth_bytes_s = _device_to_peak[device]
    return CpuEstimateSource(peak_bandwidth_bytes_s)
