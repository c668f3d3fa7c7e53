"""FSDP2 HSDP sharding for inference. Knows nothing of checkpoint files or HTTP.

Names and semantics follow vLLM-Omni's HSDP inference helpers.
"""

from shard_engine.config import MESH_AXES, HSDPInferenceConfig, build_hsdp_mesh
from shard_engine.overlap import (
    Residency,
    disable_forward_prefetch,
    enable_forward_prefetch,
    local_parameter_bytes,
    set_resident_units,
    shared_weights_of,
)
from shard_engine.shm import remove_owned_now, sweep_stale
from shard_engine.shm_all_gather import (
    SharedMemoryAllGather,
    SharedMemoryPool,
    enable_shared_memory_all_gather,
    slots_for_depth,
)
from shard_engine.sharding import (
    HSDPShardContext,
    apply_hsdp_to_model,
    default_device,
    finalize_hsdp_root,
    hsdp_root_unsharded,
    parameter_like,
    prepare_hsdp_shard_context,
    shard_hsdp_module,
    shard_model,
)
from shard_engine.units import (
    default_shard_conditions,
    detect_decoder_layer_names,
    find_ignored_param_names,
    fsdp_units,
    owning_unit,
    select_units,
    tied_across_units,
)

__all__ = [
    "MESH_AXES",
    "HSDPInferenceConfig",
    "HSDPShardContext",
    "Residency",
    "SharedMemoryAllGather",
    "SharedMemoryPool",
    "apply_hsdp_to_model",
    "build_hsdp_mesh",
    "default_device",
    "default_shard_conditions",
    "detect_decoder_layer_names",
    "disable_forward_prefetch",
    "enable_forward_prefetch",
    "enable_shared_memory_all_gather",
    "finalize_hsdp_root",
    "find_ignored_param_names",
    "fsdp_units",
    "hsdp_root_unsharded",
    "local_parameter_bytes",
    "owning_unit",
    "parameter_like",
    "prepare_hsdp_shard_context",
    "select_units",
    "set_resident_units",
    "shared_weights_of",
    "shard_hsdp_module",
    "shard_model",
    "slots_for_depth",
    "tied_across_units",
    "remove_owned_now",
    "sweep_stale",
]
