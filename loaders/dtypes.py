"""Which floating dtypes a device computes in natively, and the dtype ``auto`` loads a checkpoint as.

On a CPU without bf16 instructions (AVX512-BF16 or AMX on x86, the BF16 extension on Arm) a
bf16 matmul is emulated: measured 0.7 GFLOP/s against 62 in float32 on one such AMD EPYC
(64x768 @ 768x3072, torch 2.13), about 90x slower. fp16 is the same story without
AVX512-FP16/AMX-FP16 (or Arm's half-precision arithmetic). ``auto`` therefore loads such
checkpoints as float32 there, and says so; an explicit dtype is always obeyed.
"""

from __future__ import annotations

import functools
import platform

import torch

_X86_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}
_ARM_FEATURES = {torch.bfloat16: ("bf16",), torch.float16: ("fphp", "asimdhp")}


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native(dtype: torch.dtype) -> bool:
    """Whether this CPU has arithmetic instructions for ``dtype`` (float32 and wider: always)."""
    if dtype not in _X86_FLAGS:
        return True
    table = _ARM_FEATURES if platform.machine().lower() in ("aarch64", "arm64") else _X86_FLAGS
    return any(flag in _cpu_flags() for flag in table[dtype])


def auto_dtype(checkpoint_dtype: torch.dtype, device: torch.device | str) -> tuple[torch.dtype, str | None]:
    """The dtype ``auto`` computes in for a checkpoint stored as ``checkpoint_dtype`` on ``device``,
    and why it differs from the checkpoint's (None when it does not)."""
    device = torch.device(device)
    if device.type == "cpu" and not cpu_has_native(checkpoint_dtype):
        name = str(checkpoint_dtype).removeprefix("torch.")
        return torch.float32, (f"this CPU has no native {name} arithmetic, so {name} matmuls would be emulated "
                               f"(~50-100x slower than float32): loading the {name} checkpoint as float32 "
                               f"(--dtype {name} keeps it as it is)")
    return checkpoint_dtype, None
