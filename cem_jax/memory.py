"""How much memory a device has, and the refusal, before anything is allocated or written, of a
size that cannot fit (a model or a decode cache whose estimate alone exceeds it)."""

from __future__ import annotations

import jax

GB = 1e9


class DoesNotFit(ValueError):
    """An estimate of the memory a command needs exceeds the memory there is."""


def device_memory_bytes(device: jax.Device | None = None) -> int | None:
    """Bytes of memory of `device` (default: the first local device): an accelerator's own
    (`memory_stats()["bytes_limit"]`); for a CPU device, its share of the host's available memory
    (MemAvailable of /proc/meminfo over the process's CPU devices, which share it). None when
    unknown (no such statistics and no /proc/meminfo)."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats()
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if device.platform != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    return available // len(jax.local_devices(backend="cpu"))


def check_fits(need: int, what: str, advice: str, device: jax.Device | None = None) -> None:
    """Raise DoesNotFit ("{what} needs at least N GB ... {advice}") when `need` bytes (a lower
    bound: the real peak is higher) exceed `device_memory_bytes(device)`; nothing when the
    memory is unknown."""
    have = device_memory_bytes(device)
    if have is not None and need > have:
        device = device or jax.local_devices()[0]
        raise DoesNotFit(f"{what} needs at least {need / GB:,.1f} GB, more than the "
                         f"{have / GB:,.1f} GB of memory there is ({device.platform} device "
                         f"{device.id}); {advice}")


def is_out_of_memory(err: Exception) -> bool:
    """Whether a `jax.errors.JaxRuntimeError` is XLA's out-of-memory (RESOURCE_EXHAUSTED, or
    "Out of memory" inside another status, as XLA CPU's dispatch reports it)."""
    return "RESOURCE_EXHAUSTED" in str(err) or "Out of memory" in str(err)
