"""The server's configuration: one declaration per option, and the two ways to set it.

:class:`ServeConfig` is the declaration. Each field carries its flag, help and group in an
:class:`Option`; from it come the command line (``--max-total-tokens``), the environment
variable (``HSDP_MAX_TOTAL_TOKENS``, the flag in upper case with ``HSDP_`` in front) and the
documentation. A flag given on the command line beats the variable, which beats the default;
an empty variable counts as unset. ``docker/entrypoint.sh`` passes nothing on: the server reads
its own variables, so a key set as ``HSDP_API_KEY`` never appears on a command line.
:data:`ENVIRONMENT` declares the variables that are not options; any other ``HSDP_*`` name is
warned about, since a misspelt variable would otherwise be ignored without a word.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields

from loaders.modes import READ_MODES
from shard_engine.modes import ENCODER_MODES

LOG_LEVELS = ("debug", "info", "warning", "error")


DEVICE_TYPES = ("cpu", "cuda")


def int_or_keyword(keyword: str, keyword_value, minimum: int):
    """An argparse type: an integer >= ``minimum``, or ``keyword``, which parses to ``keyword_value``."""

    def parse(text: str):
        if text == keyword:
            return keyword_value
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer or {keyword!r}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


parse_nproc_per_node = int_or_keyword("auto", None, 1)
"""argparse type for ``--nproc-per-node``: a positive integer, or ``auto`` (None)."""


def read_secret_file(path: str, what: str) -> bytes:
    """A secret's file (a Docker or Kubernetes secret), stripped; ValueError naming ``what`` (the
    flag or variable that gave the path) where it is unreadable or empty."""
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as e:
        raise ValueError(f"{what} {path}: {e.strerror}") from None
    if not secret:
        raise ValueError(f"{what} {path}: empty")
    return secret


DTYPES = ("auto", "float32", "bfloat16", "float16")
ALL_GATHERS = ("auto", "shm", "group")
COMPILE_MODES = ("none", "decode")  # server.engine.compiled
COMPILE_REGIONS = ("layer", "model")  # server.engine.compiled
PACKED_LINEAR_MODES = ("auto", "on", "off")  # server.engine.linears
QUANTIZE_ON_LOAD = ("none", "int8", "fp8")  # loaders.quantization.on_load
TOOL_CALL_PARSERS = ("hermes",)  # server.api.openai.tools.FORMATS, checked there


def parse_resident_units(text: str) -> int | None:
    """argparse type for ``--resident-units``: an integer >= 0, ``all`` (-1) or ``auto`` (None)."""
    return None if text == "auto" else int_or_keyword("all", -1, 0)(text)
MIN_STEP_TIMEOUT_S = 2.0
ENV_PREFIX = "HSDP_"
GROUPS = ("model", "group", "http", "admission", "limits", "memory", "timeouts", "speed")
LIMIT_GROUPS = ("limits", "timeouts")
"""The groups docs/options.md's "Limits and timeouts" table lists, after :data:`CONNECTION_LIMITS`."""
CONNECTION_LIMITS = ("max_body_bytes", "max_buffered_body_bytes", "max_connections")
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


COMPILE_SIZES_EXPECTED = "expected positive batch sizes such as 1,2,4,8,16, the largest optionally N+ with N >= 2 (1,2+)"


@dataclass(frozen=True)
class CompileSizes:
    """``--compile-batch-sizes``: the decode graphs a rank compiles. ``static``: a graph per size,
    a step padded to the smallest that holds it (what a CUDA graph needs); ``open_from`` (spelt
    ``N+``, the largest size): one graph whose batch dimension stays symbolic, for every step of at
    least N sequences (or padded up to N), none padded further. Spelt back as parsed
    (``1,2+``)."""

    static: tuple[int, ...]
    open_from: int | None = None

    def __post_init__(self):
        static, open_from = self.static, self.open_from
        if (not static and open_from is None) or list(static) != sorted(set(static)) or (static and static[0] < 1) or (
                open_from is not None and (open_from < 2 or (static and static[-1] >= open_from))):
            raise ValueError(f"{COMPILE_SIZES_EXPECTED}; got {self}")

    def __str__(self) -> str:
        return ",".join([*map(str, self.static), *([f"{self.open_from}+"] if self.open_from else [])])

    @property
    def graphs(self) -> int:
        return len(self.static) + (self.open_from is not None)

    def in_open_graph(self, batch: int) -> bool:
        """Whether a (padded) step of ``batch`` sequences runs in the open graph."""
        return self.open_from is not None and batch >= self.open_from


def parse_batch_sizes(text: str) -> CompileSizes | None:
    """argparse type for ``--compile-batch-sizes``: positive integers, comma-separated (1,2,4,8),
    the largest optionally ``N+`` (N >= 2: a batch of one cannot stay symbolic), or ``auto`` (None:
    :data:`COMPILE_BATCH_SIZES` for the ranks' device)."""
    if text.strip() == "auto":
        return None
    parts = [part.strip() for part in text.split(",") if part.strip()]
    open_from = None
    if parts and parts[-1].endswith("+"):
        open_from = parts.pop()[:-1]
    try:
        return CompileSizes(tuple(sorted({int(part) for part in parts})),
                            int(open_from) if open_from is not None else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{COMPILE_SIZES_EXPECTED}; got {text!r}") from None


PREFILL_TOKENS = {"cpu": 512, "cuda": 8192}
"""``--max-batch-prefill-tokens auto`` per device. A CPU rank computes a prompt at about its
arithmetic rate (512 tokens of an 80M model: a step of a few hundred ms beside the decoding
sequences); a GPU runs a step of thousands of tokens in milliseconds, and a cap of 512 would only
multiply the steps a long prompt takes (vLLM's chunked prefill on GPUs: 8192 a step)."""
PREFILL_SHARE = {"cpu": 8, "cuda": 1}
"""How far the prompts in flight on a rank share its step's prefill budget, per device: on CPU
down to an eighth (a step's prompt tokens cost their arithmetic on one core, so a wave of 16
clients' prompts in one 512-token step held every first token to the whole wave's: shared, the
85M's TTFT p50 at 16 clients went from 0.70-0.80x transformers serve's to 0.45-0.77x; RESULTS.md,
session 24); on GPUs not at all (a step of thousands of tokens takes milliseconds there: more
steps would only add their fixed cost; not measured)."""
COMPILE_BATCH_SIZES = {"cpu": CompileSizes((1,), open_from=2), "cuda": CompileSizes((1, 2, 4, 8, 16, 32, 64, 128))}
"""``--compile-batch-sizes auto`` per device, the graphs compiled at startup. On CPU two: one
sequence, and every larger batch in one graph of symbolic batch (inductor's CPU loops lose
nothing to it; each graph costs dynamo's trace of the whole model, 5-8 s at 24 layers with
inductor's cache filled, so five static sizes took twice as long to be ready, and left steps of
more than 16 sequences eager). On GPUs a graph per size, padded to it: the static shapes CUDA
graphs need; a GPU's step stays host-bound far past 16 (the gpu_check's loads: 32 and 128
sequences)."""


def parse_size(text: str) -> int | None:
    """A memory size: bytes, or a number with a unit (64MiB, 2GiB, 1.5GB); ``auto``: None."""
    import re

    if text.strip().lower() == "auto":
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 512MiB, 2GiB or a number of bytes, or auto; "
                                          f"got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_switch(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected 1/0, true/false, yes/no or on/off, got {text!r}")


@dataclass(frozen=True)
class Option:
    """How one ServeConfig field is set and documented."""

    help: str
    group: str
    flag: str | None = None  # default: the field's name, dashed
    type: Callable[[str], object] | None = None
    choices: tuple | None = None
    metavar: str | None = None
    secret: bool = False  # never shown: not in --help defaults, not in logs
    switch: bool = False  # a boolean: --NAME / --no-NAME, and 1/0, true/false, yes/no as a variable
    none_means: str | None = None  # how a user spells the None default ("auto"), where it has a spelling


def option(default, help: str, group: str, **kwargs):
    return field(default=default, metadata={"option": Option(help, group, **kwargs)})


def flag_of(f) -> str:
    return f.metadata["option"].flag or "--" + f.name.replace("_", "-")


def env_of(f) -> str:
    return ENV_PREFIX + flag_of(f).removeprefix("--").replace("-", "_").upper()


@dataclass(kw_only=True)
class ServeConfig:
    model: str | None = option(
        None, "checkpoint: a local directory, an s3://bucket/prefix or a Hugging Face repo id (org/name); default: the "
        "embedded SmolLM2-135M-Instruct (the random-weight demo where that cannot be fetched)", "model",
        metavar="DIR|S3URL|ORG/NAME")
    revision: str | None = option(None, "branch, tag or commit of a Hub repo id (default: main)", "model")
    served_model_name: str | None = option(
        None, "the name OpenAI clients give as `model` (default: the repo id, or the directory's name)", "model",
        metavar="NAME")
    chat_template: str | None = option(
        None, "a Jinja chat template used instead of the tokenizer's: a file, or the template itself", "model",
        metavar="FILE")
    tool_call_parser: str = option("hermes", "the model's tool-call format, how tools are shown to it and its calls "
                                   "read: hermes (<tool_call>{json}</tool_call>: Hermes, Qwen)", "model",
                                   choices=TOOL_CALL_PARSERS, metavar="NAME")
    dtype: str = option("auto", "weights' dtype; auto keeps the checkpoint's, but loads bf16/fp16 as float32 on "
                        "a CPU without native support for them", "model", choices=DTYPES)
    quantization: str = option(
        "none", "quantize a bf16/fp16/fp32 checkpoint's linears while it streams, each rank its own rows, one scale "
        "per output row (lm_head and embeddings stay as they are): int8 or fp8 (e4m3) weights, computed "
        "dequantized in the model's dtype; a checkpoint that ships quantized is served as it ships", "model",
        choices=QUANTIZE_ON_LOAD)
    mm_encoder: str = option(
        "shard", "an image-text model's vision encoder and projector: shard (FSDP units like the decoder's, each "
        "rank reading and holding its rows) or replicate (whole on every rank: no all-gathers when it encodes)",
        "model", choices=ENCODER_MODES)
    mm_embedding_cache: int = option(
        256 << 20, "an image-text model's image embeddings each rank keeps, in host memory, by the image's content: "
        "an image seen again on that rank is not encoded again (whatever text comes before it); 0: none",
        "model", type=parse_size, metavar="BYTES")
    read_mode: str = option("sliced", "sliced: each rank reads only its own rows; full: whole tensors", "model",
                            choices=READ_MODES)
    load_concurrency: int = option(8, "reads a rank keeps in flight: ranged GETs of an s3:// checkpoint; "
                                      "reads ahead of a local one where the host has cores its ranks leave idle",
                                   "model", type=int, metavar="N")
    load_mmap: bool = option(
        True, "on a CPU, take each rank's rows of a checkpoint file in the page cache as views of a private mapping "
        "of it (no fresh memory, no copy: llama.cpp's and from_pretrained's CPU default) instead of reading them; "
        "such files must then not be rewritten in place while served (write new files and rename them: "
        "--no-load-mmap where a trainer overwrites them)", "model", switch=True)
    load_from_peer: str | None = option(
        None, "receive the weights from a running hsdp-serve that serves the same checkpoint with --share-weights "
        "(its URL; the API key, if any, is this server's own): each rank gets its rows from the peer's ranks that "
        "hold them; the checkpoint's config and headers are still read here, and any failure or refusal falls back "
        "to reading it", "model", metavar="URL")
    share_weights: bool = option(
        False, "let a server started with --load-from-peer (holding the API key) receive this one's weights from its "
        "ranks while they serve", "model", switch=True)

    nproc_per_node: int | None = option(
        None, "ranks on this node: a number, or auto (one per visible GPU on cuda, 2 on cpu); torchrun decides "
        "under torchrun", "group", type=parse_nproc_per_node, metavar="N|auto")
    replicate_size: int | None = option(
        None, "replicas of the model (the mesh is replicate x shard); auto: world size / shard size where that is "
        "given, else one replica per node under torchrun with several nodes (each node's ranks one shard group, so "
        "all-gathers stay on the node's fast links), else 1", "group", type=int_or_keyword("auto", None, 1),
        metavar="N|auto", none_means="auto")
    shard_size: int = option(-1, "ranks per replica; -1: world size / replicate size", "group", type=int)
    device: str | None = option(None, "cpu (gloo) or cuda (NCCL, one GPU per rank); default: cuda when available",
                                "group", choices=DEVICE_TYPES)

    host: str = option("127.0.0.1", "address to listen on", "http")
    port: int = option(8000, "port to listen on", "http", type=int)
    log_level: str | None = option(None, "every process's level (default: rank 0 info, the others warning)",
                                   "http", choices=LOG_LEVELS)
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' on every endpoint but /health and "
                                 "/ready (and /metrics with --open-metrics); printable ASCII; prefer the variable "
                                 "or a file to the flag", "http",
                                 metavar="KEY", secret=True)
    api_key_file: str | None = option(None, "read the API key from this file (a Docker or Kubernetes secret); "
                                      "wins over the key", "http", metavar="PATH")
    max_body_bytes: int = option(1024 * 1024, "largest request body; larger ones get 413", "http", type=int)
    max_buffered_body_bytes: int = option(
        64 * 1024 * 1024, "request bodies held in memory at once over all connections (bodies are read whole "
        "before a route runs); a body that would pass it gets 503, so stalled uploads cannot fill rank 0's memory",
        "http", type=parse_size, metavar="SIZE")
    max_connections: int = option(
        1000, "open HTTP connections at once; a request on a connection beyond it gets 503 (a file descriptor and "
        "a few KiB each: the cap keeps a flood of idle sockets from exhausting rank 0)", "http", type=int,
        metavar="N")
    allowed_hosts: str | None = option(
        None, "Host header values accepted, comma-separated (a port may follow each); others get 403, which stops "
        "DNS rebinding; default: localhost, 127.0.0.1 and [::1] when listening on loopback, any host otherwise",
        "http", metavar="HOST,...")
    open_metrics: bool = option(False, "serve /metrics without the API key (for a scraper that cannot send one); "
                                "by default /metrics needs the key when one is set", "http", switch=True)

    max_concurrent_requests: int = option(128, "sequences decoding at once over the whole group; more wait",
                                          "admission", type=int)
    max_queued_requests: int = option(256, "requests waiting beyond the running ones; more get 429", "admission",
                                      type=int)
    max_input_tokens: int | None = option(None, "longest prompt (default: max total tokens - 1)", "admission",
                                          type=int)
    max_total_tokens: int | None = option(None, "prompt plus new tokens (default: the model's positions, at most "
                                          "4096)", "admission", type=int)

    max_sequences_per_request: int = option(
        64, "sequences one request may start: prompts x n (OpenAI), best_of (TGI); more get 4xx naming the "
        "parameter", "limits", type=int, metavar="N")
    max_stop_sequences: int = option(16, "stop sequences one request may give", "limits", type=int, metavar="N")
    max_stop_sequence_chars: int = option(
        256, "longest stop sequence in characters (each is looked for at every token)", "limits", type=int,
        metavar="N")
    max_top_logprobs: int = option(20, "alternatives per token a request may ask for (logprobs, top_logprobs, "
                                   "top_n_tokens)", "limits", type=int, metavar="N")
    max_images_per_request: int = option(
        8, "images one request may bring (an image-text model's chat image_url parts, TGI's markdown images)", "limits",
        type=int, metavar="N")
    max_image_bytes: int = option(
        20 * 10**6, "largest image file a request may bring (a data: URL's decoded bytes, a file, a download); a "
        "data: URL counts against --max-body-bytes too", "limits", type=parse_size, metavar="BYTES")
    max_image_pixels: int = option(
        25 * 10**6, "most pixels (width x height) of one image, checked from its header before it is decoded",
        "limits", type=int, metavar="N")
    allowed_local_media_path: str | None = option(
        None, "a directory whose files requests may name as images (file:// URLs); none when unset", "limits",
        metavar="DIR")
    allow_remote_media: bool = option(
        False, "let requests name images by http:// and https:// URLs, fetched by rank 0", "limits", switch=True)
    max_tokenize_tokens: int = option(
        16384, "tokens one /tokenize answer may carry (its spans are built and written on rank 0's event loop); a "
        "longer text gets 4xx", "limits", type=int, metavar="N")

    kv_cache_memory: int | None = option(
        None, "KV cache per rank, allocated once at startup: a size (512MiB, 2GiB) or auto (on CPU a fifth of the "
        "node's available memory shared by its ranks; on a GPU 90% of what is free after the weights, less 1 GiB "
        "for activations)", "memory", type=parse_size, metavar="SIZE|auto")
    kv_block_size: int = option(16, "tokens per KV cache block (the unit of allocation and of prefix sharing)",
                                "memory", type=int, metavar="N")
    max_batch_prefill_tokens: int | None = option(
        None, "prompt tokens a rank computes per step at most (on CPU shared by the prompts in flight on it, never "
        "below an eighth): longer prompts are split over steps while the other sequences go on decoding; "
        f"auto: {PREFILL_TOKENS['cpu']} on CPU ranks, {PREFILL_TOKENS['cuda']} on GPUs",
        "memory", type=int_or_keyword("auto", None, 1), metavar="N|auto", none_means="auto")
    prefix_caching: bool = option(True, "reuse the KV blocks of prompts' common prefixes (--no-prefix-caching: "
                                  "off)", "memory", switch=True)

    header_timeout_s: float = option(
        30.0, "a connection must finish sending a request's headers within this (from connecting, or from the end "
        "of its previous response plus the keep-alive wait), else 408 and closed (nginx: 60 s)", "timeouts",
        flag="--header-timeout", type=float, metavar="S")
    body_timeout_s: float = option(
        60.0, "a request's body must arrive whole within this, else 408 (nginx: 60 s between two reads)",
        "timeouts", flag="--body-timeout", type=float, metavar="S")
    keep_alive_timeout_s: float = option(
        5.0, "an idle connection between requests is closed after this (uvicorn's default)", "timeouts",
        flag="--keep-alive-timeout", type=float, metavar="S")
    slow_reader_timeout_s: float = option(
        30.0, "a client that takes nothing of its response for this long is cut off: the connection closed, its "
        "sequences cancelled and their KV blocks freed", "timeouts", flag="--slow-reader-timeout", type=float,
        metavar="S")
    liveness_timeout_s: float = option(
        60.0, "GET /health fails (503) when work is waiting and no step has ended for this long, so an orchestrator "
        "restarts a stuck group long before --step-timeout", "timeouts", flag="--liveness-timeout", type=float,
        metavar="S")
    step_timeout_s: float = option(300.0, "a step (one forward on every rank, the control channel included) "
                                   f"longer than this dumps stacks and stops the group; at least {MIN_STEP_TIMEOUT_S:g}",
                                   "timeouts", flag="--step-timeout", type=float, metavar="S")
    shutdown_timeout_s: float = option(30.0, "on SIGTERM or Ctrl-C, how long in-flight requests may take to finish",
                                       "timeouts", flag="--shutdown-timeout", type=float, metavar="S")
    collective_timeout_s: float = option(600.0, "bound on any single collective", "timeouts",
                                         flag="--collective-timeout", type=float, metavar="S")
    media_timeout_s: float = option(10.0, "fetching one remote image (--allow-remote-media) may take this long",
                                    "timeouts", flag="--media-timeout", type=float, metavar="S")
    peer_timeout_s: float = option(60.0, "a transfer of weights from or to a peer group (--load-from-peer, "
                                   "--share-weights) waiting this long for a rank is abandoned; the receiver then "
                                   "reads storage", "timeouts", flag="--peer-timeout", type=float, metavar="S")

    prefetch_depth: int = option(2, "units whose all-gathers each unit's forward starts ahead; 0: none", "speed",
                                 type=int, metavar="N")
    all_gather: str = option("auto", "shm: through shared memory (CPU ranks of one host), resident units in one "
                             "shared copy per host; group: the process group's (gloo, NCCL), resident units copied "
                             "on every rank; auto: shm where every rank maps the same /dev/shm", "speed",
                             choices=ALL_GATHERS)
    compile: str = option(
        "none", "decode: decode steps run through torch.compile'd code (inductor) instead of eager module calls, and "
        "with --compile-region layer so do steps that carry prompt chunks, through the open size's graph (needs "
        "every unit resident; compiled at startup while /ready says compiling: see --compile-region); none: eager",
        "speed", choices=COMPILE_MODES)
    compile_region: str = option(
        "layer", "--compile decode: what one graph covers. layer: a decoder layer, one graph that every layer of a kind "
        "shares, called without dynamo between layers and kept on disk beside inductor's cache (on 2 CPU cores a "
        "first start takes about 15-25 s more than eager's, shared out among a host's ranks; a later one 1-4 s more: "
        "the graphs are loaded, not traced); model: the whole forward in one graph, which also compiles the "
        "embeddings, masks and head around the layers but traces and compiles every layer at every start (80-100 s "
        "more the first time, about 16 s with inductor's cache filled)", "speed",
        choices=COMPILE_REGIONS)
    compile_batch_sizes: CompileSizes | None = option(
        None, "--compile decode: the batch sizes a rank's decode step is padded to, a graph each, compiled "
        "at startup; the largest spelt N+: one graph of symbolic batch for every step of N or more sequences; "
        "larger decode steps than the largest size run eagerly; auto: "
        f"{COMPILE_BATCH_SIZES['cpu']} on CPU ranks, {COMPILE_BATCH_SIZES['cuda']} on GPUs", "speed",
        type=parse_batch_sizes, metavar="N,N,...[,N+]|auto", none_means="auto")
    packed_linears: str = option(
        "auto", "linear layers on oneDNN's prepacked weights (CPU: torch's plain bf16 linear reads a weight at about "
        "half their speed; one more private copy of the linears' weights per rank); auto: bf16 models with every unit "
        "resident whose copies take at most a quarter of the available memory; on: also float32 (may differ from "
        "eager in the last bits); off",
        "speed", choices=PACKED_LINEAR_MODES)
    resident_units: int | None = option(
        None, "units (in forward order) that keep their gathered parameters; all: every unit; auto: all where the "
        "shard group shares one host's memory (one shared copy per host, no more memory than the shards), else 0",
        "speed", type=parse_resident_units, metavar="K|all|auto", none_means="auto")

    def __post_init__(self) -> None:
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        for f in fields(self):
            allowed = f.metadata["option"].choices
            value = getattr(self, f.name)
            if allowed is not None and value is not None and value not in allowed:
                raise ValueError(f"{flag_of(f)} must be one of {allowed}, got {value!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        for name in ("max_concurrent_requests", "max_input_tokens", "max_total_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests must be >= 0, got {self.max_queued_requests}")
        if self.shutdown_timeout_s < 0:
            raise ValueError("--shutdown-timeout must be >= 0")
        if self.step_timeout_s < MIN_STEP_TIMEOUT_S:
            # ranks other than 0 wait for the next plan under the watch, up to rank 0's idle wait (1 s)
            raise ValueError(f"--step-timeout must be >= {MIN_STEP_TIMEOUT_S:g} s, got {self.step_timeout_s:g}")
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be >= 1, got {self.max_body_bytes}")
        if self.max_buffered_body_bytes < self.max_body_bytes:
            raise ValueError(f"--max-buffered-body-bytes ({self.max_buffered_body_bytes}) must be >= "
                             f"--max-body-bytes ({self.max_body_bytes})")
        for name in ("max_connections", "max_sequences_per_request", "max_stop_sequence_chars", "max_tokenize_tokens",
                     "max_image_bytes", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("max_stop_sequences", "max_top_logprobs", "max_images_per_request", "mm_embedding_cache"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s", "slow_reader_timeout_s",
                     "liveness_timeout_s", "peer_timeout_s", "media_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.removesuffix('_s').replace('_', '-')} must be positive")
        if self.api_key is not None:
            check_api_key(self.api_key)
        if not 1 <= self.load_concurrency <= 64:
            raise ValueError(f"--load-concurrency must be in 1..64, got {self.load_concurrency}")
        if self.prefetch_depth < 0:
            raise ValueError(f"--prefetch-depth must be >= 0, got {self.prefetch_depth}")
        if self.resident_units is not None and self.resident_units < -1:
            raise ValueError(f"--resident-units must be >= 0 or 'all', got {self.resident_units}")
        if self.collective_timeout_s <= 0:
            raise ValueError("--collective-timeout must be positive")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"--kv-cache-memory must be positive, got {self.kv_cache_memory}")
        if not 1 <= self.kv_block_size <= 1024:
            raise ValueError(f"--kv-block-size must be in 1..1024, got {self.kv_block_size}")
        if self.max_batch_prefill_tokens is not None and self.max_batch_prefill_tokens < 1:
            raise ValueError(f"--max-batch-prefill-tokens must be >= 1, got {self.max_batch_prefill_tokens}")
        if self.load_from_peer is not None and not self.load_from_peer.startswith(("http://", "https://")):
            raise ValueError(f"--load-from-peer must be an http:// or https:// URL, got {self.load_from_peer!r}")
        if self.allowed_local_media_path is not None and not os.path.isdir(self.allowed_local_media_path):
            raise ValueError(f"--allowed-local-media-path {self.allowed_local_media_path!r} is not a directory")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("--served-model-name must not be empty")

    def mesh_config(self, world_size: int, local_world_size: int):
        """The HSDP config of ``--replicate-size`` and ``--shard-size`` for this group (``auto``
        resolved as the flag says; ``local_world_size``: the ranks on each node)."""
        from shard_engine import HSDPInferenceConfig

        replicate = self.replicate_size
        if replicate is None:
            nodes = world_size // local_world_size if world_size % local_world_size == 0 else 1
            if self.shard_size != -1:
                replicate = max(1, world_size // self.shard_size)
            elif nodes > 1:
                return HSDPInferenceConfig(replicate_size=nodes, shard_size=local_world_size, encoder=self.mm_encoder)
            else:
                replicate = 1
        return HSDPInferenceConfig(replicate_size=replicate, shard_size=self.shard_size, encoder=self.mm_encoder)

    @property
    def torch_dtype(self):
        import torch

        return None if self.dtype == "auto" else getattr(torch, self.dtype)

    def prefill_tokens_for(self, device_type: str) -> int:
        """``--max-batch-prefill-tokens`` on ranks of ``device_type`` (``auto`` resolved)."""
        return self.max_batch_prefill_tokens or PREFILL_TOKENS.get(device_type, PREFILL_TOKENS["cuda"])

    @staticmethod
    def prefill_share_for(device_type: str) -> int:
        """:data:`PREFILL_SHARE` of ``device_type``."""
        return PREFILL_SHARE.get(device_type, PREFILL_SHARE["cuda"])

    def compile_batch_sizes_for(self, device_type: str) -> CompileSizes:
        """``--compile-batch-sizes`` on ranks of ``device_type`` (``auto`` resolved)."""
        return self.compile_batch_sizes or COMPILE_BATCH_SIZES.get(device_type, COMPILE_BATCH_SIZES["cuda"])


OPTIONS = [f for f in fields(ServeConfig) if "option" in f.metadata]

ENVIRONMENT = {
    "HSDP_CACHE_DIR": "where the default and demo checkpoints are written (default ~/.cache/hsdp-serve)",
    "HSDP_PROBE_HOST": "host the health probe (python -m server.probe) dials (default 127.0.0.1)",
    "HSDP_INJECT_FORWARD_FAULT": "fault drills only: RANK:N raises inside forward N on that rank",
    "HSDP_INJECT_FORWARD_DELAY": "fault drills only: RANK:SECONDS makes every forward of that rank this much slower",
    "HSDP_INJECT_LOAD_DELAY": "fault drills only: SECONDS of delay after each tensor a rank loads",
    "HSDP_INJECT_GRAMMAR_LIMITS": "fault drills only: llguidance parser limits (NAME=N,...) for every grammar",
    "HSDP_DRY_RUN": "docker/entrypoint.sh: print the command it would run, and exit",
    "HSDP_NNODES": "docker/entrypoint.sh: nodes in the group; above 1 it starts torchrun",
    "HSDP_NODE_RANK": "docker/entrypoint.sh: this node's rank (0 serves HTTP)",
    "HSDP_MASTER_ADDR": "docker/entrypoint.sh: node rank 0's address",
    "HSDP_MASTER_PORT": "docker/entrypoint.sh: the rendezvous port (default 29500)",
    "HSDP_CONTROL_HOST": "several nodes: the address of rank 0's node its control link listens on and the ranks dial",
    "HSDP_GROUP_SECRET": "several nodes: a secret every rank proves it knows (HMAC) before the group starts",
    "HSDP_GROUP_SECRET_FILE": "a file holding HSDP_GROUP_SECRET (a mounted Secret); set one of the two",
}
"""Variables read by the server, its probe or its entrypoint that are not options."""


def show_default(f) -> str | None:
    """The default as a user would type it, or None where there is none to show."""
    if f.default is None and f.metadata["option"].none_means:
        return f.metadata["option"].none_means
    if f.default is MISSING or f.default is None or f.metadata["option"].secret:
        return None
    if f.metadata["option"].switch:
        return "on" if f.default else "off"
    if isinstance(f.default, tuple):  # spelled as the flag takes it
        return ",".join(map(str, f.default))
    return f"{f.default:g}" if isinstance(f.default, float) else str(f.default)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hsdp-serve",
        description="Serve a Hugging Face causal LM sharded over a group of ranks with FSDP2 (HSDP). Every flag "
                    f"can also be set as a variable: --max-total-tokens as {ENV_PREFIX}MAX_TOTAL_TOKENS.",
    )
    add_options(p, [f.name for f in OPTIONS])
    return p


def add_options(parser: argparse.ArgumentParser, names) -> None:
    """The flags of the named options, as ``hsdp-serve`` declares them (``hsdp-load`` takes the
    options it shares with the server from here)."""
    by_name = {f.name: f for f in OPTIONS}
    for name in names:
        f = by_name[name]
        o = f.metadata["option"]
        shown = show_default(f)
        # argparse %-formats help texts: a literal % (as in "90% of what is free") must be doubled
        help_text = (o.help + (f" (default: {shown})" if shown else "")).replace("%", "%%")
        if o.switch:
            parser.add_argument(flag_of(f), dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                                help=help_text)
            continue
        parser.add_argument(flag_of(f), dest=f.name, type=o.type, choices=o.choices, metavar=o.metavar,
                            default=f.default, help=help_text)


def _parse_env(f, text: str):
    o = f.metadata["option"]
    if o.switch:
        return parse_switch(text)
    value = o.type(text) if o.type is not None else text
    if o.choices is not None and value not in o.choices:
        raise ValueError(f"must be one of {o.choices}")
    return value


def parse_serve_config(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> ServeConfig:
    """Flags over ``HSDP_*`` variables over defaults; exits with a usage error naming the culprit."""
    environ = os.environ if environ is None else environ
    parser = build_parser()
    from_env = {}
    for f in OPTIONS:
        text = environ.get(env_of(f), "")
        if text:
            try:
                from_env[f.name] = _parse_env(f, text)
            except (ValueError, argparse.ArgumentTypeError) as e:
                shown = "***" if f.metadata["option"].secret else repr(text)
                parser.error(f"{env_of(f)}={shown}: {e}")
    parser.set_defaults(**from_env)
    args = parser.parse_args(argv)
    try:
        if args.api_key_file:
            args.api_key = read_key_file(args.api_key_file)
        return ServeConfig(**vars(args))
    except ValueError as e:
        parser.error(str(e))


def check_api_key(key: str) -> None:
    """An API key must be something a header carries byte for byte: visible ASCII, no spaces (a
    key with other characters is refused at startup rather than failing every request later)."""
    if not key or any(not 0x21 <= ord(c) <= 0x7E for c in key):
        raise ValueError("the API key must be printable ASCII without spaces (what an Authorization header "
                         "carries unchanged); generate one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'")


def read_key_file(path: str) -> str:

    key = read_secret_file(path, "--api-key-file")
    try:
        return key.decode()
    except UnicodeDecodeError:
        raise ValueError(f"--api-key-file {path}: not text") from None


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """``HSDP_*`` names in the environment that nothing reads."""
    environ = os.environ if environ is None else environ
    known = {env_of(f) for f in OPTIONS} | set(ENVIRONMENT)
    return sorted(name for name in environ if name.startswith(ENV_PREFIX) and name not in known)


def render_options_markdown() -> str:
    """docs/options.md's table of options, generated from the declaration."""
    rows = ["| flag | variable | default | what |", "|---|---|---|---|"]
    for group in GROUPS:
        for f in OPTIONS:
            o = f.metadata["option"]
            if o.group != group:
                continue
            spelled = flag_of(f) + (f" {o.metavar}" if o.metavar else "")
            if o.switch:
                spelled = f"{flag_of(f)}, --no-{flag_of(f).removeprefix('--')}"
            if o.choices:
                spelled = flag_of(f) + " " + "|".join(o.choices)
            spelled = spelled.replace("|", "\\|")  # inside a Markdown table
            rows.append(f"| `{spelled}` | `{env_of(f)}` | {show_default(f) or ''} | {o.help} |")
    return "\n".join(rows)


def render_limits_markdown() -> str:
    """docs/options.md's "Limits and timeouts" table: every bound on what a client may send, ask for or
    withhold, from the same declaration."""
    rows = ["| limit | default | what happens past it, and why |", "|---|---|---|"]
    chosen = [f for f in OPTIONS if f.name in CONNECTION_LIMITS]
    chosen += [f for group in LIMIT_GROUPS for f in OPTIONS if f.metadata["option"].group == group]
    for f in chosen:
        o = f.metadata["option"]
        spelled = (flag_of(f) + (f" {o.metavar}" if o.metavar else "")).replace("|", "\\|")
        rows.append(f"| `{spelled}` | {show_default(f) or ''} | {o.help} |")
    return "\n".join(rows)


if __name__ == "__main__":
    import sys

    print(render_limits_markdown() if "--limits" in sys.argv else render_options_markdown())
