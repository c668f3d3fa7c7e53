"""The serving engine: rank 0 plans every step of every replica (``scheduler``, ``blocks``; one
scheduler per step group behind ``step_groups``' router), every rank computes its share of it (``rank``: the paged KV cache and attention of ``attention``, the batched
sampler of ``sampling``); ``plan`` holds what crosses the control channel between them.

Token ids only: text belongs to the API side (``server.api.detokenize``).
"""

from server.engine.blocks import BlockPool
from server.engine.plan import SequenceAdd, StepPlan, StepResult, TokenResult, Work
from server.engine.rank import KVGeometry, RankEngine, size_kv_pool
from server.engine.step_groups import StepGroupRouter
from server.engine.sampling import SamplingParams
from server.engine.scheduler import ErrorEvent, RequestHandle, Scheduler, TokenEvent, choose_seed

__all__ = [
    "BlockPool",
    "ErrorEvent",
    "KVGeometry",
    "RankEngine",
    "StepGroupRouter",
    "RequestHandle",
    "SamplingParams",
    "Scheduler",
    "SequenceAdd",
    "StepPlan",
    "StepResult",
    "TokenEvent",
    "TokenResult",
    "Work",
    "choose_seed",
    "size_kv_pool",
]
