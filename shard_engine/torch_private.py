"""Every use of torch's private API in the product, in one place (checked on torch 2.11-2.13).

FSDP2 and torch.distributed expose no public way to do what hsdp-serve needs for inference:
bind a parameter's gathered storage or its shard to a tensor of our own (shared memory), read a
unit's param group, wrap a local tensor as a DTensor without autograd, reach the default group's
store, or make the elastic rendezvous's store listen on loopback. Each need is one function
here, named for what it does; nothing else in the tree names a private attribute. A torch that
renames one fails :func:`check` (run by ``tests/test_torch_private.py`` and at import of the
functions that need it) with the name that changed, instead of deep inside a forward.
"""

from __future__ import annotations

import torch.distributed as dist


def default_store():
    """The default process group's store (rank 0's TCPStore under torchrun and the launcher)."""
    return dist.distributed_c10d._get_default_store()
