"""HSDP inference configuration and the device mesh it describes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shard_engine.modes import ENCODER_MODES, MESH_AXES


@dataclass(kw_only=True)
class HSDPInferenceConfig:
    """How a model is sharded for inference: a ``replicate`` x ``shard`` mesh and FSDP2 policies."""

    replicate_size: int = 1
    """Number of replicas along the ``replicate`` axis (full copies of the sharded model)."""

    shard_size: int = -1
    """Ranks one copy of the model is sharded over; -1 means ``world_size // replicate_size``."""

    param_dtype: torch.dtype | None = None
    """Dtype parameters are all-gathered and computed in; None computes in the loaded dtype."""

    reduce_dtype: torch.dtype | None = None
    """Dtype of gradient reductions (unused for inference, kept for API parity)."""

    output_dtype: torch.dtype | None = None
    """Dtype each sharded unit casts its floating-point outputs to; None leaves them as computed."""

    reshard_after_forward: bool = True
    """Free the gathered parameters of each unit after its forward (memory) or keep them (speed)."""

    cpu_offload: bool = False
    """Keep sharded parameters in host memory and copy them to the accelerator for each forward."""

    encoder: str = "shard"
    """An image-text model's vision encoder and projector: FSDP units like the decoder's (``"shard"``)
    or whole on every rank (``"replicate"``), as ``shard_engine.units.default_shard_conditions`` says."""

    def __post_init__(self) -> None:
        if not isinstance(self.replicate_size, int) or self.replicate_size < 1:
            raise ValueError(f"replicate_size must be a positive int, got {self.replicate_size!r}")
        if not isinstance(self.shard_size, int) or (self.shard_size < 1 and self.shard_size != -1):
            raise ValueError(f"shard_size must be a positive int or -1, got {self.shard_size!r}")
        if self.encoder not in ENCODER_MODES:
            raise ValueError(f"encoder must be one of {ENCODER_MODES}, got {self.encoder!r}")
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(f"{name} must be a floating torch.dtype or None, got {value!r}")
        if dist.is_available() and dist.is_initialized():
            self.resolve_mesh_shape(dist.get_world_size())

    def resolve_mesh_shape(self, world_size: int) -> tuple[int, int]:
        """The (replicate, shard) mesh shape for ``world_size`` ranks; ValueError if it does not fit."""
        if world_size % self.replicate_size != 0:
            raise ValueError(
                f"replicate_size={self.replicate_size} does not divide world_size={world_size}"
            )
        shard_size = world_size // self.replicate_size if self.shard_size == -1 else self.shard_size
        if self.replicate_size * shard_size != world_size:
            raise ValueError(
                f"HSDP mesh replicate_size={self.replicate_size} x shard_size={shard_size} = "
                f"{self.replicate_size * shard_size} does not match world_size={world_size}"
            )
        return self.replicate_size, shard_size


class SlicedOnceMesh(DeviceMesh):
    """A DeviceMesh whose slices (``mesh["shard"]``) are made once and kept. FSDP2 slices a 2-D
    mesh once per parameter it shards (``FSDPParam._init_shard_mesh``), and torch 2.13 makes each
    slice anew from its layout algebra: 80 us a parameter on this project's CPU (0.6 us kept), so
    about 5 s a rank for a model of 60,000 parameters (DeepSeek-V3's order) and 10 ms for a 1.5 GB
    Llama's 120. A slice is the same sub-mesh every time (the same ranks and process group), so one
    is kept per name."""

    def __getitem__(self, mesh_dim_names):
        key = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
        slices = self.__dict__.setdefault("_hsdp_slices", {})
        if key not in slices:
            slices[key] = super().__getitem__(mesh_dim_names)
        return slices[key]


def build_hsdp_mesh(hsdp_config: HSDPInferenceConfig, device_type: str) -> DeviceMesh:
    """Build the 2-D ``("replicate", "shard")`` mesh over the initialised default process group
    (a :class:`SlicedOnceMesh`)."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before building the HSDP mesh")
    shape = hsdp_config.resolve_mesh_shape(dist.get_world_size())
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)
    mesh.__class__ = SlicedOnceMesh
    return mesh
