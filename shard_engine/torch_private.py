"""Every use of torch's private API in the product, in one place.

FSDP2 and torch.distributed expose no public way to do what hsdp-serve needs for inference:
bind a parameter's gathered storage or its shard to a tensor of our own (shared memory), read a
unit's param group and the shape of its parameters, issue a unit's all-gathers asynchronously,
subclass the all-gather comm, wrap a local tensor as a DTensor without autograd or a device move,
replace a module's parameters as FSDP2 itself does, reach the default group's store, or make the
elastic rendezvous's store listen on loopback, import the compiler ahead of a first
``torch.compile``, call a graph compiled ahead of time without dynamo's frame hook or AOTAutograd's
runtime wrapper. Each need is one function here, named for what it does; nothing else in the tree
names a private torch attribute or module (``tests/test_torch_private.py`` scans for the names of
:data:`RELIED_ON`), and nothing else reads the attributes of FSDP2's private classes (``FSDPParam``,
``FSDPParamGroup``), public ones included: this module alone knows their shape.

Checked on torch 2.13.0 (this project's CPU build). pyproject.toml allows torch >=2.8,<2.15;
other versions in that range are not verified here: :func:`check` is. It verifies that every
name of :data:`RELIED_ON` exists on the running torch (on a 1-rank FSDP2 unit it builds) and
raises one error naming each one missing and the torch version, instead of an AttributeError
deep inside a forward. ``tests/test_torch_private.py`` runs it. The one override that would fail
silently (the rendezvous store's, which would then listen on every interface) checks its own
name each time it is used.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import AllGather, DefaultAllGather
from torch.distributed.tensor import DTensor

RELIED_ON: dict[str, tuple[str, ...]] = {
    # torch modules (dotted): the names taken from them
    "torch": ("_foreach_copy_",),
    "torch.distributed.distributed_c10d": ("_get_default_store",),
    "torch.distributed.fsdp._fully_shard._fsdp_common": ("_from_local_no_grad",),
    "torch.distributed.fsdp._fully_shard._fsdp_collectives": ("AllGather", "DefaultAllGather"),
    "torch.distributed.fsdp._fully_shard._fully_shard": ("get_cls_to_fsdp_cls",),
    "torch._inductor.compile_fx": ("compile_fx",),
    "torch._inductor.cpu_vec_isa": ("pick_vec_isa",),
    "torch._inductor.output_code": ("CompiledFxGraph",),  # its current_callable: CompiledCall.go_direct
    "torch._inductor.fx_passes.decompose_mem_bound_mm": ("cpu_max_other_dimension_decomposition",),
    "torch._inductor.config": ("get_config_copy", "_compile_ignored_keys"),
    "torch._dynamo.config": ("get_config_copy", "_compile_ignored_keys"),
    "torch._dynamo.utils": ("call_size",),  # and whatever else dynamo's code reads of it: _DynamoHelpers
    # (and its __post_init__'s own use of its dataclass field _artifacts, which a class lookup cannot see)
    "torch._dynamo.aot_compile.AOTCompiledFunction": ("guard_check", "serialize", "deserialize", "_extra_globals"),
    # torch classes (dotted): methods called or overridden
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous.DynamicRendezvousHandler": (
        "_create_tcp_store_server",),
    "torch.distributed.fsdp.FSDPModule": ("_get_fsdp_state", "_set_unshard_async_op"),
    # the objects of a gathered FSDP2 unit: attributes read or written (set at init or lazily)
    "FSDPState": ("_fsdp_param_group", "_pre_forward_hook_handle", "_post_forward_hook_handle", "_mp_policy",
                  "_lazy_init"),
    "FSDPParamGroup": ("_reshard_after_forward", "fsdp_params", "is_unsharded", "lazy_init", "device"),
    "FSDPParam": ("_sharded_param_data", "_sharded_local_tensor", "_unsharded_param", "_orig_size",
                  "_contiguous_orig_stride", "_module_info", "all_gather_outputs", "sharded_param",
                  "sharded_size", "padded_sharded_param_size", "fsdp_placement", "mesh_info", "mp_policy"),
    "ParamModuleInfo": ("module", "shared_modules", "param_name", "shared_param_names"),
    "FSDPMeshInfo": ("shard_process_group", "shard_mesh_rank", "shard_mesh_size"),
    "DTensor": ("_local_tensor", "_spec"),
    "Module": ("_parameters", "_buffers", "_forward_pre_hooks", "_forward_hooks"),
}
"""What this module relies on, owner -> names; :func:`check` looks each one up."""


# FSDP2 units (FSDPModule) and their param groups


def param_group(unit: FSDPModule):
    """FSDP2's parameter group of ``unit`` (None for a unit whose parameters are all ignored)."""
    return unit._get_fsdp_state()._fsdp_param_group


def fsdp_params(unit: FSDPModule) -> list:
    """The unit's own sharded parameters (FSDP2's ``FSDPParam``s); none where all are ignored."""
    group = param_group(unit)
    return [] if group is None else list(group.fsdp_params)


def is_gathered(unit: FSDPModule) -> bool:
    """Whether the unit's own sharded parameters are gathered now (False where it has none)."""
    group = param_group(unit)
    return group is not None and group.is_unsharded


def reshards_after_forward(unit: FSDPModule) -> bool:
    """Whether the unit frees its gathered parameters after its forward (the unit has some)."""
    return param_group(unit)._reshard_after_forward


def shard_process_group(unit: FSDPModule) -> dist.ProcessGroup:
    """The process group the unit's parameters are sharded over (its all-gathers run on it)."""
    return param_group(unit).mesh_info.shard_process_group


def compute_device(unit: FSDPModule) -> torch.device:
    """The device the unit gathers onto and computes on."""
    return param_group(unit).device


def shard_world_size(unit: FSDPModule) -> int:
    """How many ranks the unit's parameters are sharded over."""
    return param_group(unit).mesh_info.shard_mesh_size


def finish_lazy_init(unit: FSDPModule) -> None:
    """Run FSDP2's lazy init of the unit's group now (idempotent): it adopts replaced sharded
    parameters and settles the mixed-precision dtypes."""
    param_group(unit).lazy_init()


def init_root(root: FSDPModule) -> None:
    """Settle ``root`` as the FSDP2 root now (idempotent, collective-free), as its first forward would:
    a unit inside it may then be called on its own first (an image encoder before the decoder) without
    becoming a root of its own, which would make the root's first forward fail."""
    root._get_fsdp_state()._lazy_init()


def forward_hooks(unit: FSDPModule) -> tuple[dict, int, dict, int]:
    """Where FSDP2's forward hooks of ``unit`` sit: (the module's pre-forward hook dict, the id
    of FSDP2's pre-forward hook in it, its post-forward hook dict, the id of FSDP2's post-forward
    hook in it). The dicts are the module's own, ordered as the hooks run."""
    state = unit._get_fsdp_state()
    return (unit._forward_pre_hooks, state._pre_forward_hook_handle.id,
            unit._forward_hooks, state._post_forward_hook_handle.id)


def casts_outputs(unit: FSDPModule) -> bool:
    """Whether the unit's post-forward hook casts its outputs (mixed precision's output_dtype)."""
    return unit._get_fsdp_state()._mp_policy.output_dtype is not None


def set_unshard_async(unit: FSDPModule, async_op: bool) -> None:
    """Issue the all-gathers of ``unit`` and the units inside it with ``async_op``."""
    unit._set_unshard_async_op(async_op)


def default_all_gather() -> AllGather:
    """FSDP2's own all-gather comm, for ``set_custom_all_gather`` to go back to it."""
    return DefaultAllGather()


# one sharded parameter (FSDPParam)


def gathered_numel(fsdp_param) -> int:
    """Elements of the whole parameter, without FSDP2's padding."""
    return fsdp_param._orig_size.numel()


def local_numel(fsdp_param) -> int:
    """Elements of this rank's shard, without FSDP2's padding."""
    return fsdp_param.sharded_size.numel()


def gathered_dtype(fsdp_param) -> torch.dtype:
    """The dtype FSDP2 gathers the parameter in: mixed precision's ``param_dtype`` for a floating
    parameter, else its own (FSDP2's lazy init settles it so; known before it too)."""
    own, wanted = fsdp_param.sharded_param.dtype, fsdp_param.mp_policy.param_dtype
    return wanted if wanted is not None and own.is_floating_point else own


def padded_shard(fsdp_param) -> torch.Tensor:
    """This rank's shard as FSDP2 keeps it: flat, padded to the chunk every rank has."""
    return fsdp_param._sharded_param_data


def local_shard(fsdp_param) -> torch.Tensor:
    """This rank's shard as the module's DTensor holds it: unpadded, a view of :func:`padded_shard`."""
    return fsdp_param.sharded_param._local_tensor


def gathered_shape(fsdp_param) -> torch.Size:
    """The whole parameter's shape."""
    return fsdp_param._orig_size


def shard_count(fsdp_param) -> int:
    """How many ranks the parameter is sharded over."""
    return fsdp_param.mesh_info.shard_mesh_size


def shard_rank(fsdp_param) -> int:
    """This rank's index among the ranks the parameter is sharded over."""
    return fsdp_param.mesh_info.shard_mesh_rank


def is_row_sharded(fsdp_param) -> bool:
    """Whether the parameter is sharded along dim 0 (``Shard(0)``: each rank's rows contiguous)."""
    return fsdp_param.fsdp_placement.dim == 0


def has_all_gather_extension(fsdp_param) -> bool:
    """Whether the local shard chooses what is gathered (``fsdp_pre_all_gather``: a tensor subclass)."""
    return hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather")


def modules_using(fsdp_param) -> tuple[nn.Module, ...]:
    """The modules that register the parameter: its own, then those it is shared (tied) with."""
    info = fsdp_param._module_info
    return (info.module, *info.shared_modules)


def registered_as(fsdp_param) -> list[tuple[nn.Module, str]]:
    """Every (module, attribute name) that registers the parameter: its own, then its tied ones."""
    info = fsdp_param._module_info
    return [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]


def gathered_output(fsdp_param) -> torch.Tensor:
    """The tensor FSDP2 copies the gathered parameter out into (padded, flat)."""
    return fsdp_param.all_gather_outputs[0]


def bind_gathered(fsdp_param, whole: torch.Tensor) -> None:
    """Make ``whole`` (flat, padded as FSDP2 gathers the parameter) the tensor FSDP2 copies the
    gathered parameter out into, and the unsharded parameter a view of it. FSDP2 allocates none
    while one of the right size is set; before the unit's first gather there is no unsharded
    parameter yet, and FSDP2 makes it a view of ``whole`` then."""
    fsdp_param.all_gather_outputs = [whole]
    if hasattr(fsdp_param, "_unsharded_param"):  # gathered before: its view is of the old tensor
        fsdp_param._unsharded_param.data = torch.as_strided(
            whole, fsdp_param._orig_size, fsdp_param._contiguous_orig_stride, storage_offset=0)


def bind_shard(fsdp_param, flat: torch.Tensor) -> None:
    """Make ``flat`` (the padded shard's elements) this rank's local shard, as FSDP2's own
    ``reset_sharded_param`` does."""
    padded = fsdp_param.padded_sharded_param_size
    length = fsdp_param.sharded_param._local_tensor.size(0)
    fsdp_param._sharded_param_data = flat
    fsdp_param.sharded_param._local_tensor = flat.view(padded).narrow(0, 0, length)


def copy_tensors(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dsts[i].copy_(srcs[i])`` for every i, in one foreach op."""
    torch._foreach_copy_(dsts, srcs)


# DTensors and modules


def sharded_parameter(template: DTensor, local: torch.Tensor) -> nn.Parameter:
    """``nn.Parameter(DTensor(local, template's spec), requires_grad=False)``, built directly: the
    public path (``DTensor.from_local``'s autograd function, then the ``detach`` in
    ``nn.Parameter.__new__``) dispatches twice through DTensor's sharding propagation, half a
    millisecond a parameter of a load's shard phase (a 13-layer Llama's 120: 0.06 s a rank).
    ``local`` stays on its device. What ``nn.Parameter.__new__`` does for a tensor subclass but its
    ``detach``: the instance is marked ``_is_param``, which ``isinstance(x, nn.Parameter)`` reads."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _from_local_no_grad

    value = _from_local_no_grad(local.detach() if local.requires_grad else local, template._spec)
    value._is_param = True
    return value


def local_shape(sharded: DTensor) -> torch.Size:
    """The shape of this rank's local tensor of ``sharded``, read without ``to_local``'s dispatch."""
    return sharded._local_tensor.shape


def set_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Put ``param`` in ``module``'s slot ``name`` as it is, without ``nn.Module.__setattr__``'s
    checks and hooks (FSDP2's own ``unsafe_setattr_param`` does so)."""
    module._parameters[name] = param


def set_buffer(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put ``tensor`` in ``module``'s existing buffer slot ``name``, its persistence kept."""
    module._buffers[name] = tensor


_MIXED: dict[tuple[type, type], type] = {}  # (mixin, class) -> the class mix_into_class made of them


def mix_into_class(module: nn.Module, mixin: type, prefix: str, home, attrs: dict | None = None) -> None:
    """Give ``module`` a class ``<prefix><X>`` of ``mixin`` ahead of its own class ``X`` (``attrs``
    its class attributes), defined in module ``home`` (picklable by name: dynamo's guards of a graph
    kept on disk name the classes they check). An FSDP2 unit's class is ``FSDP<X>`` of
    ``FSDPModule`` and ``X``, kept in fully_shard's class mapping, where dynamo's guards look it up:
    the mixin goes under it, as ``FSDP<prefix><X>`` of ``FSDPModule`` and the mixed class, mapped
    as fully_shard maps its own (a class of the mixin over ``FSDP<X>`` is in no mapping: a compiled
    layer's guards then fail to save)."""
    from torch.distributed.fsdp._fully_shard._fully_shard import get_cls_to_fsdp_cls

    cls = type(module)
    unit = isinstance(module, FSDPModule)
    base = cls.__mro__[2] if unit else cls  # fully_shard's (FSDP<X>, FSDPModule, X)
    name = prefix + base.__name__
    mixed = _MIXED.get((mixin, base))
    if mixed is None:
        mixed = _MIXED[(mixin, base)] = type(name, (mixin, base), {"__module__": home.__name__, **(attrs or {})})
        setattr(home, name, mixed)
    if unit:
        classes = get_cls_to_fsdp_cls()
        if mixed not in classes:
            # (fully_shard's class dict: its __deepcopy__ that refuses)
            own = {k: v for k, v in vars(cls).items() if k == "__deepcopy__"}
            classes[mixed] = type(f"FSDP{name}", (FSDPModule, mixed), own)
        mixed = classes[mixed]
    module.__class__ = mixed


# process groups and the elastic rendezvous


def nccl_backend(store, rank: int, world_size: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A ``ProcessGroupNCCL`` over ``store`` apart from the default group, whose operations time out
    after ``timeout`` (its options' ``_timeout``: CUDA builds only, so not in :data:`RELIED_ON`'s
    CPU check)."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def default_store():
    """The default process group's store (rank 0's TCPStore under torchrun and the launcher)."""
    return dist.distributed_c10d._get_default_store()


def loopback_rendezvous_handler(params, store, backend, *, local_addr: str, timeout,
                                store_server: Callable[[], dist.TCPStore]):
    """torch's c10d dynamic rendezvous handler (``DynamicRendezvousHandler.from_backend`` over
    ``params``' run id and node counts) whose store for the ranks is ``store_server()`` instead
    of the TCPStore torch would create, listening on every interface."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    if not hasattr(DynamicRendezvousHandler, "_create_tcp_store_server"):  # else ignored, silently
        raise RuntimeError(f"torch {torch.__version__}: DynamicRendezvousHandler._create_tcp_store_server "
                           "is gone; the ranks' store cannot be kept on loopback")

    class LoopbackRendezvousHandler(DynamicRendezvousHandler):
        def _create_tcp_store_server(self, master_addr, master_port):
            return store_server()

    return LoopbackRendezvousHandler.from_backend(
        params.run_id, store, backend, params.min_nodes, params.max_nodes, local_addr, timeout)


# the compiler


def import_compiler(device_type: str) -> None:
    """Imports dynamo and inductor, and on CPU has inductor pick its vector ISA (it compiles a probe
    program, once a process): what a first ``torch.compile`` call would otherwise do."""
    importlib.import_module("torch._dynamo")
    importlib.import_module("torch._inductor.compile_fx")
    if device_type == "cpu":
        importlib.import_module("torch._inductor.cpu_vec_isa").pick_vec_isa()


class CompiledCall:
    """One graph dynamo traced ahead of time (``torch.compile(fn, fullgraph=True).aot_compile``:
    torch's precompile API) from example arguments, or loaded from where one was saved:
    :attr:`call` is its generated code as a plain function of ``fn``'s arguments, run without
    dynamo's frame hook or guards (the caller knows which graph fits a call); :meth:`fits`
    evaluates its guards on other arguments (a traced graph's only: a loaded one has none)."""

    def __init__(self, function, traced: bool):
        self._function = function
        self.traced = traced
        self.call: Callable = _without_dynamo_wrappers(function.fn)
        self.wrapped: str | None = None  # after go_direct: why calls still go through the wrapper
        self.direct_tried = False

    @classmethod
    def trace(cls, compiled_fn: Callable, args: tuple, kwargs: dict) -> CompiledCall:
        """``compiled_fn``: a ``torch.compile(fn, fullgraph=True)``; dynamo traces ``fn(*args, **kwargs)``
        and inductor compiles the graph (its on-disk caches are not consulted: a saved graph is the cache)."""
        return cls(compiled_fn.aot_compile((args, kwargs)), traced=True)

    @classmethod
    def load(cls, data: bytes, fn: Callable) -> CompiledCall:
        """A graph of ``fn`` that :meth:`save` wrote (same torch; the caller keys what else it depends
        on). Its guards are not rebuilt: they name the classes of the modules traced, and FSDP2 makes
        a class of each wrapped module's in every process (``FSDPLlamaDecoderLayer``), which a later
        process's guards do not find."""
        from torch._dynamo.aot_compile import AOTCompiledFunction

        class Unguarded(AOTCompiledFunction):
            def __post_init__(self) -> None:  # AOTCompiledFunction's, less the guards' rebuild
                self._artifacts.check_compatibility()
                self.fn = self._artifacts.runtime_env.forward_callable(
                    self._artifacts.backend_id, self._artifacts.compiled_fn, extra_globals=self._extra_globals)

        return cls(Unguarded.deserialize(data, f_globals=fn.__globals__), traced=False)

    def save(self) -> bytes:
        from torch._dynamo.aot_compile import AOTCompiledFunction

        return AOTCompiledFunction.serialize(self._function).serialized_data

    def fits(self, *args, **kwargs) -> bool:
        """Whether this traced graph's guards pass on these arguments (every one evaluated)."""
        return self.traced and bool(self._function.guard_check(*args, **kwargs))

    def go_direct(self, args: tuple, kwargs: dict, output, before_again: Callable[[], None] | None = None
                  ) -> str | None:
        """From now on :attr:`call` enters inductor's generated code directly, past AOTAutograd's
        runtime wrapper and inductor's ``OutputCode`` call (~20 us a call of a tiny Llama layer on
        these cores, of ~130), where the wrapper has nothing to do for this graph: an inference graph
        (no backward, no tensor subclass) whose input mutations are all inside the graph (the KV
        writes), none of whose outputs alias an input or another output, and that leaves grad mode
        as it found it. Dynamo's code before the graph stays: it gathers the graph's inputs. With
        grad enabled (never in a step) a call goes through the wrapper, which turns grad off.
        Checked here: ``args``/``kwargs`` called again (the caller has just called :attr:`call` on
        them and got ``output``; a second call writes the same keys and values) must give ``output``
        bit for bit, else the wrapper stays. Returns why it stays, None where it went (also kept
        in :attr:`wrapped`); once per graph: a later call returns the first answer. ``before_again``:
        puts back what the first call changed that its second would read (a stateful layer's states)."""
        if not self.direct_tried:
            self.direct_tried = True
            self.wrapped = self._go_direct(args, kwargs, output, before_again)
        return self.wrapped

    def _go_direct(self, args: tuple, kwargs: dict, output, before_again) -> str | None:
        fn = self.call
        names = [name for name in fn.__code__.co_names if name.startswith("__compiled_fn")]
        if len(names) != 1:
            return f"dynamo's code calls {len(names)} graphs"
        backend = fn.__globals__[names[0]]
        try:
            entry = backend.serialize()  # AOTAutograd's result: what the runtime wrapper was built from
            meta = entry.runtime_metadata
            kept = {"a backward": entry.compiled_bw is not None,
                    "tensor subclasses": entry.maybe_subclass_meta is not None,
                    "input mutations outside the graph": meta.num_mutated_inp_runtime_indices > 0,
                    "outputs aliasing inputs": meta.num_outputs_aliased > 0 or meta.num_intermediate_bases > 0,
                    "a change of grad mode": meta.grad_enabled_mutation is not None}
        except Exception as e:  # noqa: BLE001 - another torch's layout: the wrapper stays
            return f"its AOTAutograd metadata is not readable ({type(e).__name__}: {e})"
        if any(kept.values()):
            return "the graph has " + ", ".join(why for why, found in kept.items() if found)
        graphs = _compiled_fx_graphs(backend)
        if len(graphs) != 1:
            return f"{len(graphs)} inductor graphs found behind its wrapper"
        code = graphs[0].current_callable

        def direct(*graph_args):
            if torch.is_grad_enabled():
                return backend(*graph_args)
            return code(list(graph_args))

        fn.__globals__[names[0]] = direct
        try:
            if before_again is not None:
                before_again()
            again = fn(*args, **kwargs)
            why = _differs(output, again)
        except Exception as e:  # noqa: BLE001 - the wrapper stays
            why = f"fails ({type(e).__name__}: {e})"
        if why:
            fn.__globals__[names[0]] = backend
            return f"called directly, it {why}"
        return None


def _compiled_fx_graphs(root) -> list:
    """The inductor graphs (``CompiledFxGraph``) reachable from ``root`` through the closures and
    ``compiled_fn`` / ``__wrapped__`` attributes of AOTAutograd's wrappers."""
    from torch._inductor.output_code import CompiledFxGraph

    found, seen, stack = [], set(), [(root, 0)]
    while stack:
        obj, depth = stack.pop()
        if id(obj) in seen or depth > 12:
            continue
        seen.add(id(obj))
        if isinstance(obj, CompiledFxGraph):
            found.append(obj)
            continue
        inner = [vars(obj).get(name) for name in ("compiled_fn", "__wrapped__") if hasattr(obj, "__dict__")]
        for cell in getattr(obj, "__closure__", None) or ():
            with contextlib.suppress(ValueError):  # an empty cell
                inner.append(cell.cell_contents)
        stack.extend((o, depth + 1) for o in inner if callable(o) and not isinstance(o, type))
    return found


def _differs(expected, got) -> str | None:
    """How ``got`` (tensors, or tuples and lists of them) is not ``expected`` bit for bit; None: it is."""
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            return f"returns {type(got).__name__} where {type(expected).__name__} of {len(expected)} was"
        return next((why for e, g in zip(expected, got) if (why := _differs(e, g))), None)
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
            return "returns another shape or dtype"
        return None if torch.equal(got, expected) else "computes other values"
    return None if got == expected else "returns another value"


_DYNAMO_UTILS = "__import_torch_dot__dynamo_dot_utils"
"""The global through which dynamo's generated code reaches ``torch._dynamo.utils``."""


class _DynamoHelpers:
    """``torch._dynamo.utils`` as dynamo's generated code sees it, its functions without their
    ``torch._disable_dynamo`` wrappers. The code before a graph reads its symbolic sizes through
    ``call_size`` and marks itself for the profiler: seven calls a layer's call, each wrapper
    switching dynamo's frame hook off and on again (~5 us: 40 of a layer's ~190 us on these cores).
    The wrappers keep dynamo from tracing the helpers when they run under it; a graph's code called
    as a plain function (:attr:`CompiledCall.call`) never does."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name: str):
        import inspect

        value = inspect.unwrap(getattr(self._module, name))
        setattr(self, name, value)
        return value


def _without_dynamo_wrappers(fn: Callable) -> Callable:
    """``fn`` (dynamo's code of a traced function, with globals of its own) reaching
    ``torch._dynamo.utils`` through :class:`_DynamoHelpers`."""
    module = fn.__globals__.get(_DYNAMO_UTILS)
    if module is not None and not isinstance(module, _DynamoHelpers):
        fn.__globals__[_DYNAMO_UTILS] = _DynamoHelpers(module)
    return fn


def decompose_one_row_products(max_dim: int) -> None:
    """Inductor's ``decompose_mm_pass`` (enabled by a compile's options) makes a CPU product of
    one row by a matrix of at most ``max_dim`` on each side a reduction of its own code. Its
    bound is a module global read from the config when the pass's module is first imported
    (2048 by default, below most heads and many MLPs): raised here, for every compile after."""
    module = importlib.import_module("torch._inductor.fx_passes.decompose_mem_bound_mm")
    module.cpu_max_other_dimension_decomposition = max(module.cpu_max_other_dimension_decomposition, max_dim)


def compiler_settings() -> str:
    """What else shapes the code inductor generates in this process: its own and dynamo's settings
    (less those they mark as not affecting compiled code) and the float32 matmul precisions, as one
    string that is the same in every process with the same settings (the configs' own hashes are
    not: a set's order follows the process's hash seed)."""
    parts = []
    for name in ("torch._inductor.config", "torch._dynamo.config"):
        config = importlib.import_module(name)
        ignored = config._compile_ignored_keys
        parts.append(sorted((key, _stable(value)) for key, value in config.get_config_copy().items()
                            if key not in ignored))
    parts.append([torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
                  torch.backends.cudnn.allow_tf32])
    return repr(parts)


def _stable(value) -> str:
    if isinstance(value, (set, frozenset)):
        return repr(sorted(map(_stable, value)))
    if isinstance(value, dict):
        return repr(sorted((_stable(k), _stable(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return repr([_stable(v) for v in value])
    return repr(value)


def compiler_target(device_type: str) -> str:
    """What inductor's code for ``device_type`` is built for: on CPU the vector ISA it picked (its
    C++ kernels use it), on CUDA the device's compute capability."""
    if device_type == "cpu":
        return str(importlib.import_module("torch._inductor.cpu_vec_isa").pick_vec_isa())
    if device_type == "cuda":
        return "sm_%d%d" % torch.cuda.get_device_capability()
    return device_type


# check()


def check() -> None:
    """Raise RuntimeError naming every name of :data:`RELIED_ON` that this torch lacks, and the
    torch version. Builds one tiny FSDP2 unit on the CPU and gathers it once, over a 1-rank gloo
    group of its own where no process group is initialised, else over the default one, which
    must have one rank (ValueError otherwise)."""
    missing = [f"{owner}.{name}" for owner, obj in _torch_objects().items()
               for name in RELIED_ON[owner] if obj is None or not hasattr(obj, name)]
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
    elif dist.get_world_size() != 1:
        raise ValueError("check() gathers a 1-rank unit: call it with no process group, or a 1-rank one")
    try:
        missing += _missing_on_unit()
    finally:
        if own_group:
            dist.destroy_process_group()
    if missing:
        raise RuntimeError(f"torch {torch.__version__} lacks what shard_engine.torch_private relies on "
                           f"(checked on torch 2.13): {', '.join(missing)}")


def _torch_objects() -> dict[str, object]:
    """The dotted owners of :data:`RELIED_ON` (modules, or classes in them), None where absent."""
    found = {}
    for owner in filter(lambda o: "." in o or o == "torch", RELIED_ON):
        try:
            found[owner] = importlib.import_module(owner)
        except ImportError:
            module, _, name = owner.rpartition(".")
            try:
                found[owner] = getattr(importlib.import_module(module), name, None)
            except ImportError:
                found[owner] = None
    return found


def _missing_on_unit() -> list[str]:
    """The names of :data:`RELIED_ON` that a gathered 1-rank unit's objects lack."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    try:
        model = nn.Sequential(nn.Linear(4, 4))
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        unit = model[0]
        unit.unshard()  # the unsharded parameter exists once gathered
        fsdp_param = fsdp_params(unit)[0]
        objects = {"FSDPState": unit._get_fsdp_state(), "FSDPParamGroup": param_group(unit),
                   "FSDPParam": fsdp_param, "ParamModuleInfo": fsdp_param._module_info,
                   "FSDPMeshInfo": fsdp_param.mesh_info, "DTensor": fsdp_param.sharded_param, "Module": unit}
        unit.reshard()
    except Exception as e:  # noqa: BLE001 - a renamed attribute stops the build: that is the finding
        return [f"a 1-rank FSDP2 unit ({type(e).__name__}: {e})"]
    return [f"{owner}.{name}" for owner, obj in objects.items() for name in RELIED_ON[owner]
            if not hasattr(obj, name)]
