"""What goes over the control channel each step: rank 0's plan out, every rank's tokens back.

Plain dataclasses of token ids and block ids: no text, and no tensors but an image's pixels as
bytes (:class:`ImageInput`). Rank 0 owns every decision
(which sequence runs where, which KV blocks it uses, how many of its tokens are computed this
step); a rank keeps a mirror of its own sequences' tokens and block tables and computes what
the plan says.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.engine.sampling import SamplingParams


@dataclass
class ImageInput:
    """One image of a prompt (``server.engine.multimodal``): the processor's pixel values for it
    (float32, C order, of ``shape``), where its ``count`` placeholder tokens start in the prompt, its
    content's key (BLAKE2b of its pixels, pixel mask, shape, geometry and token count: the prefix
    cache's key for its tokens, and the image cache's; an image's own alone, whatever images it came
    with), and
    its geometry where the family's encoder takes one (Qwen-VL's patch grid [t, h, w], LLaVA-NeXT's
    original size [h, w]; else empty)."""

    key: bytes
    start: int
    count: int
    shape: list[int]
    pixels: bytes
    grid: list[int] = field(default_factory=list)
    # positions from ``start`` through its last token, where its tokens lie among others (Idefics3's tile
    # markers); 0: ``count``, contiguous. Its tokens there are those equal to the one at ``start``
    length: int = 0
    # the processor's pixel attention mask where the family takes one (Idefics3's: which pixels of each
    # tile are the image's, not padding), uint8 of ``shape`` without its channels
    mask: bytes = b""
    # its embeddings are in its rank's image cache (server.engine.multimodal.ImageCacheBook): no pixels come
    cached: bool = False

    @property
    def end(self) -> int:
        """One past the position of its last token."""
        return self.start + (self.length or self.count)


@dataclass
class SequenceAdd:
    """A sequence placed on a rank. ``tokens`` are its prompt, plus what it had generated when it
    comes back after a preemption; ``blocks`` its first KV blocks (a cached prefix among them)."""

    seq_id: int
    rank: int
    tokens: list[int]
    params: SamplingParams
    blocks: list[int]
    num_generated: int = 0
    images: list[ImageInput] = field(default_factory=list)  # those with tokens beyond its cached prefix
    # every image of its prompt as [start, count, t, h, w] where the model's rope places image tokens by
    # their grid (server.engine.multimodal.GridRope); else empty
    image_grids: list[list[int]] = field(default_factory=list)


@dataclass
class Work:
    """Compute ``count`` of a sequence's tokens from position ``start`` (their keys and values go
    into its blocks, ``new_blocks`` appended first); when that reaches its last token, sample the
    next one."""

    seq_id: int
    start: int
    count: int
    new_blocks: list[int] = field(default_factory=list)


@dataclass
class PeerShare:
    """Send this rank's shards to a peer group (``loaders.peer.send_to_peer``) on a thread of its own,
    while it goes on stepping: the peer's ranks join the transfer group on rank 0's store at
    ``port`` (every rank reaches it at the group's MASTER_ADDR) under ``key``."""

    port: int
    key: str
    receivers: tuple[int, int]  # the receiving group's mesh: (replicas, shard size)
    backend: str
    timeout_s: float


@dataclass
class TrainerTransfer:
    """Where a trainer's ranks send their shards (``server.trainer.push``): the transfer group on
    rank 0's store at ``port`` under ``key``; the trainer's mesh; for each tensor of the served
    manifest, whether the trainer holds it by rows."""

    port: int
    key: str
    senders: tuple[int, int]
    backend: str
    timeout_s: float
    sent_sharded: list[bool]


@dataclass
class WeightUpdate:
    """New weights into this rank's shards now, between two steps (``server.weights``): the
    checkpoint at ``source`` streamed, or with ``trainer`` received from a trainer's ranks; the
    plan carries no work, and the step group holds until every group has updated. ``files``: where
    the checkpoint is in object storage, its small files (config, index, ``remote.json`` naming the
    weights' objects) by name: each rank writes them into a directory of its own host and reads its
    rows from the store (``server.weights.update_directory``). ``hub``: a Hugging Face repo id at
    commit ``revision``, which each rank finds in (or downloads to) its own host's Hub cache."""

    source: str
    version: str
    trainer: TrainerTransfer | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    hub: str | None = None
    revision: str | None = None


@dataclass
class UpdateReport:
    """What a rank's update did: bytes read, seconds, or why it wrote nothing."""

    bytes_read: int
    seconds: float
    error: str | None = None


@dataclass
class StepPlan:
    """Rank 0's decisions for one step; every rank receives the same plan."""

    add: list[SequenceAdd] = field(default_factory=list)
    remove: list[int] = field(default_factory=list)
    work: dict[int, list[Work]] = field(default_factory=dict)  # rank -> its work
    forward: bool = False  # some rank has work: every rank enters forward (the all-gathers are collectives)
    shutdown: bool = False
    threads: int = 0  # intra-op threads a rank with work uses this step (server.engine.cores); 0: its own
    share: PeerShare | None = None  # a peer group asked for the weights (server.peer)
    update: WeightUpdate | None = None  # new weights now (server.weights)
    encode: bool = False  # a sequence added brings images to encode: every rank runs the image encoder (its units gather)
    # rank -> image keys its image cache lets go once this step's images are resolved (ImageCacheBook)
    forget_images: dict[int, list[bytes]] = field(default_factory=dict)


@dataclass
class TokenResult:
    seq_id: int
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    error: str | None = None  # choosing this sequence's token failed; the sequence is dropped
    stop: bool = False  # the sequence's grammar is complete: this token is its last


@dataclass
class PromptLogprobs:
    """The log-probabilities of prompt tokens ``start`` .. ``start + len(logprobs) - 1`` of a
    sequence that asked for them (``SamplingParams.prompt_logprobs``), with their alternatives."""

    seq_id: int
    start: int
    logprobs: list[float]
    top: list[list[tuple[int, float]]]


@dataclass
class StepResult:
    rank: int
    tokens: list[TokenResult]
    active: int  # sequences this rank holds after the step
    sequences_started: int  # cumulative, for the per-rank spread
    tokens_computed: int  # cumulative tokens this rank ran through the model
    pid: int  # the rank's process, for operators
    memory: dict | None = None  # the rank's memory report, every few seconds (server.group.memory)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    forwards: int = 0  # cumulative forward passes this rank ran (idle one-token forwards included)
    update: UpdateReport | None = None  # the plan's WeightUpdate, done
