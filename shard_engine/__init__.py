"""FSDP2 HSDP sharding for inference. Knows nothing of checkpoint files or HTTP.

Names and semantics follow vLLM-Omni's HSDP inference helpers.

Lazy (``shard_engine.lazy``): ``import shard_engine.modes`` brings the options' names without torch.
"""

from __future__ import annotations

from shard_engine.lazy import lazy_exports

_EXPORTS = {
    "MESH_AXES": "shard_engine.modes",
    "HSDPInferenceConfig": "shard_engine.config",
    "HSDPShardContext": "shard_engine.sharding",
    "Residency": "shard_engine.overlap",
    "SharedMemoryAllGather": "shard_engine.shm_all_gather",
    "SharedMemoryPool": "shard_engine.shm_all_gather",
    "apply_hsdp_to_model": "shard_engine.sharding",
    "build_hsdp_mesh": "shard_engine.config",
    "default_device": "shard_engine.sharding",
    "default_shard_conditions": "shard_engine.units",
    "detect_decoder_layer_names": "shard_engine.units",
    "disable_forward_prefetch": "shard_engine.overlap",
    "enable_forward_prefetch": "shard_engine.overlap",
    "enable_shared_memory_all_gather": "shard_engine.shm_all_gather",
    "finalize_hsdp_root": "shard_engine.sharding",
    "find_ignored_param_names": "shard_engine.units",
    "fsdp_units": "shard_engine.units",
    "hsdp_root_unsharded": "shard_engine.sharding",
    "local_parameter_bytes": "shard_engine.overlap",
    "owning_unit": "shard_engine.units",
    "parameter_like": "shard_engine.sharding",
    "prepare_hsdp_shard_context": "shard_engine.sharding",
    "select_units": "shard_engine.units",
    "set_resident_units": "shard_engine.overlap",
    "shared_weights_of": "shard_engine.overlap",
    "shard_hsdp_module": "shard_engine.sharding",
    "shard_model": "shard_engine.sharding",
    "slots_for_depth": "shard_engine.shm_all_gather",
    "tied_across_units": "shard_engine.units",
    "remove_owned_now": "shard_engine.shm",
    "sweep_stale": "shard_engine.shm",
}
"""Each name this package exports -> the module that declares it (imported at its first use)."""

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
