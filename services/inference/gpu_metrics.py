"""dcgm-exporter's five golden metrics of the model's GPU, read through NVML (`nvidia-ml-py`).

Named and scaled as dcgm-exporter exports them, so dashboards and alerts written for it
read these unchanged:

| family                      | NVML call                                   | unit |
|-----------------------------|---------------------------------------------|------|
| `DCGM_FI_DEV_GPU_UTIL`      | `nvmlDeviceGetUtilizationRates(h).gpu`      | %    |
| `DCGM_FI_DEV_MEM_COPY_UTIL` | `nvmlDeviceGetUtilizationRates(h).memory`   | %    |
| `DCGM_FI_DEV_FB_USED`       | `nvmlDeviceGetMemoryInfo(h).used`           | MiB  |
| `DCGM_FI_DEV_SM_CLOCK`      | `nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM)`  | MHz  |
| `DCGM_FI_DEV_POWER_USAGE`   | `nvmlDeviceGetPowerUsage(h)` (mW)           | W    |

labelled `gpu` (NVML's index), `UUID`, `device` (`nvidia<minor>`) and `modelName`, as
dcgm-exporter does. `nvidia-ml-py` is the optional `gpu` extra: on the CPU, without the
package or without a driver, `collect()` yields nothing and nothing fails. A field the
GPU does not support (power on some boards) is left out, the others still come.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("spine.inference")

LABELS = ("gpu", "UUID", "device", "modelName")
FIELDS: tuple[tuple[str, str], ...] = (
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %)."),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W)."),
)


def _import_nvml() -> Any:
    import pynvml  # nvidia-ml-py: the optional `gpu` extra

    return pynvml


class GpuGoldenMetrics(Collector):
    """The five golden metrics of the CUDA device `device` (a torch device or a device state)."""

    def __init__(self, device: Any, nvml: Callable[[], Any] = _import_nvml) -> None:
        self._device = getattr(device, "device", device)
        self._load = nvml
        self._lock = threading.Lock()
        self._nvml: Any = None
        self._handle: Any = None
        self._labels: list[str] = []
        self._off = getattr(self._device, "type", "cpu") != "cuda"

    @property
    def available(self) -> bool:
        return self._open()

    def collect(self) -> Iterator[Metric]:
        if not self._open():
            return
        nvml, handle = self._nvml, self._handle
        readings: dict[str, Callable[[], float]] = {
            "DCGM_FI_DEV_GPU_UTIL": lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
            "DCGM_FI_DEV_MEM_COPY_UTIL": lambda: nvml.nvmlDeviceGetUtilizationRates(handle).memory,
            "DCGM_FI_DEV_FB_USED": lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used / (1 << 20),
            "DCGM_FI_DEV_SM_CLOCK": lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
            "DCGM_FI_DEV_POWER_USAGE": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
        }
        for name, help_text in FIELDS:
            try:
                value = float(readings[name]())
            except Exception as error:  # NVMLError_NotSupported and friends: leave the field out
                log.debug("NVML %s unavailable: %s", name, error)
                continue
            family = GaugeMetricFamily(name, help_text, labels=LABELS)
            family.add_metric(self._labels, value)
            yield family

    def _open(self) -> bool:
        """NVML and the handle of our GPU, once; False for good when either cannot be had."""
        with self._lock:
            if self._handle is not None:
                return True
            if self._off:
                return False
            try:
                nvml = self._load()
                nvml.nvmlInit()
                handle, index = _handle_for(nvml, self._device)
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
                minor = nvml.nvmlDeviceGetMinorNumber(handle)
                name = _text(nvml.nvmlDeviceGetName(handle))
            except Exception as error:  # no package, no driver, no such device
                log.info("GPU golden metrics off: %s", error)
                self._off = True
                return False
            self._nvml, self._handle = nvml, handle
            self._labels = [str(index), uuid, f"nvidia{minor}", name]
            return True


def _handle_for(nvml: Any, device: Any) -> tuple[Any, int]:
    """NVML's handle of torch's `device`: by UUID (CUDA_VISIBLE_DEVICES renumbers devices),
    else by index."""
    index = device.index if getattr(device, "index", None) is not None else 0
    try:
        import torch

        wanted = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:
        wanted = ""
    if wanted:
        for nvml_index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(nvml_index)
            if _text(nvml.nvmlDeviceGetUUID(handle)).removeprefix("GPU-") == wanted.removeprefix("GPU-"):
                return handle, nvml_index
    return nvml.nvmlDeviceGetHandleByIndex(index), index


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
