"""Apply FSDP2 (``fully_shard``) to a model for inference, unit by unit or all at once.

Knows nothing of checkpoint files: a loader prepares an :class:`HSDPShardContext` once and
calls :func:`shard_hsdp_module` as each unit's weights complete, then
:func:`finalize_hsdp_root`. No function here runs a collective: ``fully_shard`` only
registers DTensor shards; the all-gathers happen in forward.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from shard_engine.config import HSDPInferenceConfig, build_hsdp_mesh
from shard_engine.torch_private import is_gathered, local_shape, sharded_parameter
from shard_engine.units import (
    ShardCondition,
    default_shard_conditions,
    encoder_module_names,
    find_ignored_param_names,
    select_units,
    tied_across_units,
)

logger = logging.getLogger(__name__)


def default_device() -> torch.device:
    """``cuda:LOCAL_RANK`` when the default process group runs on NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")


@dataclass
class HSDPShardContext:
    """Everything needed to shard the units of one model, prepared once before weights stream in."""

    mesh: DeviceMesh
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy
    reshard_after_forward: bool
    target_device: torch.device
    shard_conditions: list[ShardCondition]
    ignored_param_names: frozenset[str]
    root: nn.Module = field(repr=False)
    tied_param_names: frozenset[str] = frozenset()
    """Of ``ignored_param_names``, those held by modules of several units (:func:`tied_across_units`)."""

    @property
    def ignored_params(self) -> set[nn.Parameter]:
        """The ignored parameters as they are now (loading may replace Parameter objects)."""
        return {self.root.get_parameter(name) for name in self.ignored_param_names}

    def ignored_params_in(self, module: nn.Module) -> set[nn.Parameter]:
        """The ignored parameters ``module`` holds (a submodule of the root, or the root), under
        whichever name: one tied across units is held by modules of each."""
        if module is self.root:
            return self.ignored_params
        ignored = {id(p): p for p in self.ignored_params}
        return {ignored[id(p)] for p in module.parameters() if id(p) in ignored}


def prepare_hsdp_shard_context(
    model: nn.Module,
    hsdp_config: HSDPInferenceConfig,
    target_device: torch.device | None = None,
) -> HSDPShardContext:
    """Prepare mesh, precision, and ignored-parameter state for HSDP.

    The context is reused to shard completed child modules while checkpoint weights are still
    streaming, then to shard the root once all children have been loaded.
    """
    if hsdp_config.encoder == "replicate" and (encoders := encoder_module_names(model)):
        declared = list(getattr(model, "_hsdp_ignored_modules", None) or ())
        model._hsdp_ignored_modules = declared + [name for name in encoders if name not in declared]
    if getattr(model, "_hsdp_ignored_modules", None) and target_device is None:
        raise ValueError(
            "model declares _hsdp_ignored_modules: pass target_device so that they can be placed "
            "where the sharded units compute"
        )
    device = torch.device(target_device) if target_device is not None else default_device()
    mesh = build_hsdp_mesh(hsdp_config, device.type)
    if hsdp_config.cpu_offload and device.type == "cpu":
        logger.warning("cpu_offload ignored: the model already computes on the CPU")
    offload = CPUOffloadPolicy() if hsdp_config.cpu_offload and device.type != "cpu" else OffloadPolicy()
    conditions = list(getattr(model, "_hsdp_shard_conditions", None)
                      or default_shard_conditions(model, hsdp_config.encoder))
    ignored = find_ignored_param_names(model)
    tied = tied_across_units(model, select_units(model, conditions))
    if newly := tied - ignored:
        logger.info("keeping %d parameter(s) tied across FSDP units replicated (FSDP2 shards a parameter in one "
                    "unit only): %s%s", len(newly), ", ".join(sorted(newly)[:3]), ", ..." if len(newly) > 3 else "")
    # Inference only: no autograd state on the sharded or gathered parameters.
    model.requires_grad_(False)
    return HSDPShardContext(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(
            param_dtype=hsdp_config.param_dtype,
            reduce_dtype=hsdp_config.reduce_dtype,
            output_dtype=hsdp_config.output_dtype,
        ),
        offload_policy=offload,
        reshard_after_forward=hsdp_config.reshard_after_forward,
        target_device=device,
        shard_conditions=conditions,
        ignored_param_names=frozenset(ignored | tied),
        root=model,
        tied_param_names=frozenset(tied),
    )


def parameter_like(template: DTensor, local: torch.Tensor) -> nn.Parameter:
    """A parameter (no grad) over shard ``local`` with ``template``'s mesh, placements, shape and
    stride: a shard read from a checkpoint replacing the meta one ``fully_shard`` registered.

    ``local`` stays where it is (``DTensor.from_local`` would move a host tensor onto a GPU
    mesh's device, but with FSDP's CPU offload the shards live in host memory on a CUDA mesh, and
    FSDP's lazy init refuses shards elsewhere): built as FSDP builds its own shards, without
    autograd or DTensor's dispatch (:func:`shard_engine.torch_private.sharded_parameter`).
    """
    if tuple(local_shape(template)) != tuple(local.shape):
        raise ValueError(f"a shard of shape {tuple(local.shape)} for FSDP's shard of {tuple(local_shape(template))}")
    return sharded_parameter(template, local)


def _place_ignored(params: set[nn.Parameter], device: torch.device) -> None:
    # fully_shard never moves the parameters it ignores; keep the Parameter objects (and with
    # them any tying) and move their data.
    for p in params:
        if p.device != device and p.device.type != "meta":
            p.data = p.data.to(device)


def _fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None,
    reshard_after_forward: bool,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    ignored: set[nn.Parameter],
    device: torch.device | None,
) -> None:
    original = type(module)
    fully_shard(
        module,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=ignored or None,
    )
    _keep_output_capture(module, original)
    if device is not None:
        _place_ignored(ignored, device)


def _keep_output_capture(module: nn.Module, original: type) -> None:
    """``fully_shard`` swaps a unit's class for ``FSDP<Class>``; transformers looks up which outputs a
    model records (hidden states: what Llava's ``get_image_features`` selects from its vision tower)
    by the class's name, so a sharded submodel would record none. Register the swapped class as its
    original."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # transformers without output capturing: nothing is looked up by class
        return
    flags = dict.get(_CAN_RECORD_REGISTRY, str(original))  # keyed by str(class), as the registry's own get
    if flags and type(module) is not original:
        _CAN_RECORD_REGISTRY[module] = flags


def _shard_in_context(module: nn.Module, context: HSDPShardContext, ignored: set[nn.Parameter]) -> None:
    _fully_shard(
        module,
        mesh=context.mesh,
        reshard_after_forward=context.reshard_after_forward,
        mp_policy=context.mp_policy,
        offload_policy=context.offload_policy,
        ignored=ignored,
        device=context.target_device,
    )


def shard_hsdp_module(module: nn.Module, context: HSDPShardContext) -> None:
    """Shard one completed child module with a prepared HSDP context."""
    _shard_in_context(module, context, context.ignored_params_in(module))


def finalize_hsdp_root(model: nn.Module, context: HSDPShardContext) -> None:
    """Shard the model root after all selected child modules are sharded.

    The model is then ready for inference: eval mode, no parameter requires grad.
    """
    _shard_in_context(model, context, context.ignored_params)
    model.requires_grad_(False)
    model.eval()


def shard_model(
    model: nn.Module,
    *,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    mesh: DeviceMesh | None = None,
    hsdp_shard_conditions: list[Callable[[str, nn.Module], bool]],
    ignored_params: set[nn.Parameter] | None = None,
    context: HSDPShardContext | None = None,
) -> None:
    """Apply HSDP sharding to model modules based on shard conditions, then to the root.

    ``ignored_params`` are excluded from every wrap: each per-submodule wrap receives the
    subset it owns, the root wrap the full set. They keep their dtype and stay replicated.
    """
    ignored = set(ignored_params or ())

    def wrap(module: nn.Module, owned: set[nn.Parameter]) -> None:
        _fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy or MixedPrecisionPolicy(),
            offload_policy=context.offload_policy if context is not None else OffloadPolicy(),
            ignored=owned,
            device=context.target_device if context is not None else None,
        )

    for _, module in select_units(model, hsdp_shard_conditions):
        ids = {id(p) for p in module.parameters()}
        wrap(module, {p for p in ignored if id(p) in ids})
    wrap(model, ignored)


def apply_hsdp_to_model(
    model: nn.Module,
    hsdp_config: HSDPInferenceConfig,
    target_device: torch.device | None = None,
) -> nn.Module:
    """Apply HSDP sharding to a model that already has weights loaded.

    Sharded parameters move to the mesh's device; ignored parameters (and the buffers of
    ``_hsdp_ignored_modules``) are moved to ``target_device``.
    """
    context = prepare_hsdp_shard_context(model, hsdp_config, target_device)
    for name in getattr(model, "_hsdp_ignored_modules", None) or ():
        model.get_submodule(name).to(context.target_device)
    shard_model(
        model,
        reshard_after_forward=context.reshard_after_forward,
        mp_policy=context.mp_policy,
        mesh=context.mesh,
        hsdp_shard_conditions=context.shard_conditions,
        ignored_params=context.ignored_params,
        context=context,
    )
    model.requires_grad_(False)
    model.eval()
    return model


@contextlib.contextmanager
def hsdp_root_unsharded(model: nn.Module) -> Iterator[None]:
    """Gather the FSDP2 root's own parameters while a submodule of ``model`` is called directly.

    Calling a submodule skips the root's pre-forward, which would gather the parameters the
    root holds outside its units (such as tied embeddings). Collective: every rank of the
    mesh must enter and leave this context together. No-op for a model that is not an FSDP2 root,
    or whose root is resident (``set_resident_units``).
    """
    if not isinstance(model, FSDPModule):
        yield
        return
    if is_gathered(model):  # resident: gathered already, and must stay so
        yield
        return
    model.unshard()  # all-gather over the mesh
    try:
        yield
    finally:
        model.reshard()
