"""Prometheus metrics, names prefixed ``hsdp_``, in a registry of the app's own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 10.0)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# The paths requests are counted under; anything else is "other", so labels stay few.
KNOWN_ENDPOINTS = frozenset({
    "/", "/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions", "/v1/models",
    "/health", "/ready", "/info", "/metrics",
})


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("hsdp_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.request_duration = Histogram("hsdp_request_duration_seconds", "HTTP request duration, streams included",
                                          ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.time_to_first_token = Histogram("hsdp_time_to_first_token_seconds",
                                             "From a request's arrival to its first token",
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("hsdp_inter_token_latency_seconds",
                                             "Between consecutive tokens of one request",
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("hsdp_queue_time_seconds", "From a request's arrival to its admission",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.step_duration = Histogram("hsdp_step_duration_seconds",
                                       "A step group's step with a forward: rank 0's own engine step (forward and token "
                                       "choice), or the round trip for a group rank 0 drives from a thread",
                                       buckets=_STEP_BUCKETS, registry=r)
        self.control_duration = Histogram("hsdp_control_duration_seconds",
                                          "Rank 0's time in the control channel per step: plan out, tokens back, "
                                          "waiting for the slowest rank", buckets=_STEP_BUCKETS, registry=r)
        self.running = Gauge("hsdp_running_sequences", "Sequences decoding over the whole group", registry=r)
        self.waiting = Gauge("hsdp_waiting_sequences", "Requests waiting for admission", registry=r)
        self.prompt_tokens = Counter("hsdp_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("hsdp_generated_tokens", "Tokens generated for requests", registry=r)
        self.load_seconds = Gauge("hsdp_load_seconds", "Seconds rank 0 took to load and shard the model",
                                  registry=r)
        self.loaded_bytes = Gauge("hsdp_loaded_bytes", "Checkpoint bytes each rank read (or fetched from object "
                                  "storage) at startup", ["rank"], registry=r)
        self.peer_transfers = Counter("hsdp_peer_transfers", "Weight transfers with peer groups by role (sent: "
                                      "--share-weights, received: --load-from-peer) and outcome (ok, failed, refused)",
                                      ["role", "outcome"], registry=r)
        self.peer_bytes = Counter("hsdp_peer_bytes", "Bytes of shards rank 0 sent to or received from peer groups",
                                  ["role"], registry=r)
        self.weight_updates = Counter("hsdp_weight_updates", "POST /admin/weights by outcome (ok, refused, failed)",
                                      ["outcome"], registry=r)
        self.weight_update_seconds = Histogram("hsdp_weight_update_seconds", "Seconds a weight update took, from "
                                               "the request to every group serving the new weights",
                                               buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600), registry=r)
        self.weights_version = Gauge("hsdp_weights_version", "1 for the version of the weights served now (its "
                                     "label), 0 for versions served before", ["version"], registry=r)
        self.sharded_units = Gauge("hsdp_sharded_units", "FSDP units the model is sharded into", registry=r)
        self.resident_units = Gauge("hsdp_resident_units",
                                    "Units that keep their gathered parameters (--resident-units)", registry=r)
        self.resident_bytes = Gauge("hsdp_resident_bytes",
                                    "Memory a rank holds for resident units beyond its shards", ["rank"], registry=r)
        self.quantized_bytes = Gauge("hsdp_quantized_bytes", "A quantized checkpoint's tensors each rank holds, "
                                     "by kind: weights (packed or 8-bit), scales (and zero points), replicated "
                                     "(parameters kept whole on every rank)", ["rank", "kind"], registry=r)
        self.prefix_queried_tokens = Counter("hsdp_prefix_cache_queried_tokens",
                                             "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hit_tokens = Counter("hsdp_prefix_cache_hit_tokens",
                                         "Prompt tokens found in the prefix cache (not computed again)", registry=r)
        self.images = Counter("hsdp_images", "Images sent to their sequence's rank, by how: encoded (with its "
                              "pixels) or cached (its embeddings already on that rank, --mm-embedding-cache)",
                              ["how"], registry=r)
        for how in ("encoded", "cached"):
            self.images.labels(how)
        self.preemptions = Counter("hsdp_preemptions", "Sequences preempted for want of KV blocks "
                                   "(recomputed later)", registry=r)
        self.kv_blocks = Gauge("hsdp_kv_blocks", "KV cache blocks per rank by state: total, used, cached",
                               ["rank", "state"], registry=r)
        self.rank_memory = Gauge("hsdp_rank_memory_bytes", "Each rank's memory by kind: shards, resident, "
                                 "gather_ring_share, kv_pool, state_pool, runtime, and the process's rss and pss "
                                 "(on a GPU the parts are device memory, runtime is the host process's pss, and "
                                 "device_allocated and device_reserved are torch's; reported every few seconds)", ["rank", "kind"], registry=r)
        self.failures = Counter("hsdp_failures", "Failed requests by reason", ["reason"], registry=r)
        self.connections_timed_out = Counter(
            "hsdp_connections_timed_out", "Connections closed by a deadline: headers, body, slow_reader "
            "(server.http.connections, server.http.guard)", ["deadline"], registry=r)
        self.buffered_body_bytes = Gauge("hsdp_buffered_body_bytes", "Request body bytes held in memory now, "
                                         "over all connections", registry=r)

    def endpoint_label(self, path: str) -> str:
        return path if path in KNOWN_ENDPOINTS else "other"
