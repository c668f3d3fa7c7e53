"""What a load cost: bytes, time per phase, memory."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch


def read_proc_status(field_name: str) -> int:
    """A ``kB`` field of /proc/self/status in bytes (0 where /proc is not available)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) so that it measures from now on."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class LoadStats:
    read_mode: str
    checkpoint_bytes: int = 0
    quantized_layers: dict = field(default_factory=dict)  # {format description: layers} of a quantized checkpoint
    bytes_read: int = 0
    bytes_mapped: int = 0
    """Of ``bytes_read``, those taken as views of a private mapping of their file (warm local files)."""
    bytes_received: int = 0
    """Bytes received from a peer group instead of read (``loaders.peer``)."""
    tensors_written: int = 0
    """Tensors copied into a live model's shards (``update_hsdp_model``)."""
    files_read: int = 0
    tensors_read: int = 0
    tensors_converted: int = 0
    """Model tensors made by transformers' weight conversions (fused experts, say) while streaming."""
    converted_whole_bytes: int = 0
    """Bytes read whole for conversions that do not keep rows local (every rank reads them)."""
    units_sharded: int = 0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    rss_before_bytes: int = 0
    peak_rss_bytes: int = 0
    peak_device_bytes: int = 0
    # ("tensor", name) as each tensor arrives and ("shard", unit) as each unit is sharded.
    events: list[tuple[str, str]] = field(default_factory=list, repr=False)

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + time.perf_counter() - start

    def finish(self, device: torch.device) -> None:
        self.peak_rss_bytes = read_proc_status("VmHWM")
        if device.type == "cuda":
            self.peak_device_bytes = torch.cuda.max_memory_allocated(device)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("events")
        return d
