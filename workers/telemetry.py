"""Per-worker telemetry: memory-bandwidth utilisation samples for flow control.

Pluggable sources, all answering `sample(bytes_moved, elapsed_s, now) -> TelemetrySample`
once per step:
- `NvmlSource`: NVIDIA GPUs through `nvidia-ml-py` (memory-controller utilisation and
  memory used, as `nvidia-smi` reports them);
- `CpuEstimateSource`: no counter to read, so an estimate: the bytes the step moved
  (weights, KV read and written, activations; the worker computes them) over the step
  time, relative to the measured peak bandwidth;
- `ScriptedSource`: values from a script (tests, chaos runs: telemetry spikes).
The 5-second moving average that the modes use lives in flow control, not here: a
source reports what it sees now.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


class NvmlSource:
    def __init__(self, device_index: int = 0):
        import pynvml  # from nvidia-ml-py; only imported where a GPU is present

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)

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


def make_source(device: str, peak_bandwidth_bytes_s: float | None) -> TelemetrySource:
    """NVML on CUDA devices when it initialises; the CPU estimate otherwise, against the
    given peak or one measured here (a short copy probe, once per process)."""
    if device.startswith("cuda"):
        try:
            return NvmlSource(int(device.partition(":")[2] or 0))
        except Exception as err:  # no driver library, no permission: estimate instead
            logger.warning("NVML unavailable (%s); using the bandwidth estimate", err)
    if peak_bandwidth_bytes_s is None:
        if device not in _device_to_peak:
            from workers.hardware import measure_memory_bandwidth

            _device_to_peak[device] = measure_memory_bandwidth(
                nbytes=64 * 2**20, warmup=1, iters=3, device=device)
        peak_bandwidth_bytes_s = _device_to_peak[device]
    return CpuEstimateSource(peak_bandwidth_bytes_s)
