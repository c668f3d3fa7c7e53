"""``s3://`` checkpoints against a real S3 API (moto's server, on loopback): each rank reads only its
rows by ranged GETs, the tokens equal transformers', and what retrying cannot mend is one clear error."""

import os

import pytest

from tests.checkpoints import PROMPTS, generate_ids
from tests.dist import run_ranks, values
from tests.server_process import ServerProcess, free_port

BUCKET = "models"
pytest.importorskip("moto", reason="moto[server] is a test dependency (pyproject's test extra)")


@pytest.fixture(scope="module")
def s3(checkpoints, tmp_path_factory):
    """A moto S3 server with the llama checkpoint under models/llama, a truncated copy under
    models/truncated, one whose index names a missing file under models/missing and one whose
    index names a tensor its file lacks under models/phantom."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket=BUCKET)
        source = checkpoints["llama"]
        names = sorted(os.listdir(source))
        weights = [n for n in names if n.endswith(".safetensors")]
        for name in names:
            with open(os.path.join(source, name), "rb") as f:
                data = f.read()
            s3.put_object(Bucket=BUCKET, Key=f"llama/{name}", Body=data)
            # the first weights file loses its last bytes; the last one is missing from its copy
            s3.put_object(Bucket=BUCKET, Key=f"truncated/{name}", Body=data[:-100] if name == weights[0] else data)
            if name != weights[-1]:
                s3.put_object(Bucket=BUCKET, Key=f"missing/{name}", Body=data)
            if name == "model.safetensors.index.json":  # an index naming a tensor its file lacks
                import json

                index = json.loads(data)
                index["weight_map"]["model.layers.0.phantom.weight"] = weights[0]
                data = json.dumps(index).encode()
            s3.put_object(Bucket=BUCKET, Key=f"phantom/{name}", Body=data)
            s3.put_object(Bucket=BUCKET, Key=f"changed/{name}", Body=data)
        yield {"env": env, "source": source, "weights": weights, "files": names}
    finally:
        server.stop()
        for k, v in saved.items():
            if k in env:
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _local_dir(url: str, tmp_path) -> str:
    from loaders.sources import resolve_model

    return resolve_model(url, cache_dir=str(tmp_path / "cache")).path


def _load_and_generate(rank, world_size, model_dir, inject):
    import botocore.awsrequest

    from loaders import load_hsdp_model
    from loaders.remote import client
    from shard_engine import HSDPInferenceConfig

    calls = {"get": 0, "injected": 0}

    class Raw:
        def __init__(self, body: bytes):
            self.body = body

        def stream(self, **_):
            yield self.body

    def before_send(request, **_):
        if request.method != "GET" or "range" not in {k.lower() for k in request.headers}:
            return None
        calls["get"] += 1
        if inject == "throttle" and calls["injected"] < 3:  # the first three GETs: 503 SlowDown
            calls["injected"] += 1
            return botocore.awsrequest.AWSResponse(request.url, 503, {}, Raw(
                b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"))
        if inject == "denied":
            return botocore.awsrequest.AWSResponse(request.url, 403, {}, Raw(
                b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"))
        return None

    client().meta.events.register("before-send.s3.GetObject", before_send)
    try:
        loaded = load_hsdp_model(model_dir, HSDPInferenceConfig())
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(e).__name__}: {e}", "calls": calls}
    return {"ids": [generate_ids(loaded.model, loaded.tokenizer, p, 12) for p in PROMPTS],
            "bytes_read": loaded.stats.bytes_read, "total": loaded.stats.bytes_total if hasattr(
                loaded.stats, "bytes_total") else None, "calls": calls}


def test_ranks_read_their_own_rows_from_s3_and_generate_exactly(s3, references, tmp_path):
    model_dir = _local_dir(f"s3://{BUCKET}/llama", tmp_path)
    assert sorted(os.listdir(model_dir)) == sorted([n for n in s3["files"] if not n.endswith(".safetensors")]
                                                   + ["remote.json"])  # the weights stay in the store
    results = values(run_ranks(_load_and_generate, 2, tmp_path, model_dir, None, timeout=300))
    total = sum(os.path.getsize(os.path.join(s3["source"], n)) for n in s3["weights"])
    for r in results:
        assert "error" not in r, r
        assert [ids[:12] for ids in r["ids"]] == [ids[:12] for ids in references["llama"]]
        assert r["bytes_read"] < 0.65 * total, (r["bytes_read"], total)  # about half: its rows (norms whole)
        # at most two GETs per header, then one per tensor read (a small model: none split)
        assert r["calls"]["get"] <= 2 * len(s3["weights"]) + 64
    assert sum(r["bytes_read"] for r in results) >= 0.95 * total


def test_throttling_is_retried(s3, references, tmp_path):
    model_dir = _local_dir(f"s3://{BUCKET}/llama", tmp_path)
    (r,) = values(run_ranks(_load_and_generate, 1, tmp_path, model_dir, "throttle", timeout=300))
    assert "error" not in r, r
    assert r["calls"]["injected"] == 3 and [i[:12] for i in r["ids"]] == [i[:12] for i in references["llama"]]


@pytest.mark.parametrize("case, words", [
    ("denied", ["access refused", "s3://models/llama/"]),
    ("truncated", ["truncated", "s3://models/truncated/"]),
    ("missing", ["missing", "s3://models/missing/"]),
    ("phantom", ["model.layers.0.phantom.weight", "not in its file", "s3://models/phantom/"]),
])
def test_what_retrying_cannot_mend_is_one_clear_error(s3, tmp_path, case, words):
    prefix = "llama" if case == "denied" else case
    model_dir = _local_dir(f"s3://{BUCKET}/{prefix}", tmp_path)
    (r,) = values(run_ranks(_load_and_generate, 1, tmp_path, model_dir, case, timeout=300))
    assert "error" in r and all(w in r["error"] for w in words), r


def test_an_object_replaced_after_listing_is_refused_not_mixed(s3, tmp_path):
    """Every GET asks for the version listed (If-Match its ETag): an object overwritten in place
    with another of the same size is an error, not a load that mixes two versions."""
    import boto3

    model_dir = _local_dir(f"s3://{BUCKET}/changed", tmp_path)
    name = s3["weights"][0]
    with open(os.path.join(s3["source"], name), "rb") as f:
        data = bytearray(f.read())
    data[-1] ^= 0xFF  # the same size, another last byte
    boto3.client("s3").put_object(Bucket=BUCKET, Key=f"changed/{name}", Body=bytes(data))
    (r,) = values(run_ranks(_load_and_generate, 1, tmp_path, model_dir, None, timeout=300))
    assert "error" in r and "changed while loading" in r["error"] and f"changed/{name}" in r["error"], r


def test_a_missing_prefix_or_bucket_is_refused_before_loading(s3, tmp_path):
    from loaders.sources import resolve_model

    for url, words in [(f"s3://{BUCKET}/nothing-here", "no objects"), ("s3://no-such-bucket/x", "bucket")]:
        with pytest.raises(ValueError, match=words):
            resolve_model(url, cache_dir=str(tmp_path / "cache"))


@pytest.mark.slow
def test_the_server_serves_an_s3_checkpoint(s3, references, tmp_path):
    from tests.checkpoints import tokenizer

    with ServerProcess(f"s3://{BUCKET}/llama", log_path=tmp_path / "log",
                       env={**s3["env"], "HSDP_CACHE_DIR": str(tmp_path / "cache")}) as server:
        server.poll_ready(timeout=180)
        info = server.client.get("/info").json()
        assert info["model_source"] == "s3"
        total = sum(os.path.getsize(os.path.join(s3["source"], n)) for n in s3["weights"])
        assert all(r["load_bytes_read"] < 0.65 * total for r in info["ranks"]), info["ranks"]
        prompt = PROMPTS[0]
        r = server.client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 8,
                                                                                   "details": True}})
        expected = references["llama"][0][:8]
        assert [t["id"] for t in r.json()["details"]["tokens"]] == expected, tokenizer().decode(expected)
        # new weights from the store into the running server: each rank its rows, by ranged GETs
        import boto3

        from tests.checkpoints import reference_generate, write_checkpoint

        updated = write_checkpoint(tmp_path / "updated", "llama", seed=1)
        weights = [n for n in sorted(os.listdir(updated)) if n.endswith(".safetensors")]
        store = boto3.client("s3")
        for name in os.listdir(updated):
            store.upload_file(os.path.join(updated, name), BUCKET, f"updated/{name}")
        r = server.client.post("/admin/weights", json={"source": f"s3://{BUCKET}/updated", "version": "s3-step-1"})
        assert r.status_code == 200, r.text
        total = sum(os.path.getsize(os.path.join(updated, n)) for n in weights)
        assert all(read < 0.65 * total for read in r.json()["bytes_read_per_rank"]), r.json()
        r = server.client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 8,
                                                                                   "details": True}})
        assert [t["id"] for t in r.json()["details"]["tokens"]] == reference_generate(updated, [prompt], 8)[0]
        assert r.json()["details"]["weights_version"] == "s3-step-1"
        r = server.client.post("/admin/weights", json={"source": f"s3://{BUCKET}/nothing-here"})
        assert r.status_code == 422 and "no objects" in r.json()["error"], r.text
