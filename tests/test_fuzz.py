"""Property-based fuzzing of the OpenAPI schema (schemathesis) against the running server: no 5xx, no crash,
while the model loads and once it serves, with an API key set."""

import collections

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.checkpoints import write_checkpoint
from tests.server_process import ServerProcess
from tests.waiting import wait_until

EXAMPLES_PER_OPERATION = 25
EXAMPLES_WHILE_LOADING = 3
KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _is_unavailable(response) -> bool:
    try:
        body = response.json()
    except ValueError:
        return False
    error = body.get("error")
    return (body.get("phase") is not None or body.get("error_type") == "unavailable"
            or (isinstance(error, dict) and error.get("type") == "service_unavailable"))


def _fuzz_pass(schema, server, examples: int, statuses, server_errors) -> None:
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def fuzz(case):
            response = case.call(base_url=server.url, timeout=60, headers=AUTH)
            statuses[(case.method, case.path, response.status_code)] += 1
            # 503 is the answer while the model loads (with the API's error body, or a probe's); any other 5xx is a bug
            if response.status_code >= 500 and not (response.status_code == 503 and _is_unavailable(response)):
                server_errors.append((case.method, case.path, case.body, response.text[:300]))

        fuzz()
        assert server.proc.poll() is None, f"the server died: {server.log_tail()}"


@pytest.mark.timeout(560)
def test_schema_fuzz_finds_no_server_error(tmp_path):
    import schemathesis

    path = write_checkpoint(tmp_path / "llama", "llama")
    # a slowed load (200 ms a tensor, ~7 s in all: the ranks start with their imports done, so the
    # load is all that is left of a start), so that a first pass runs while the model loads
    server = ServerProcess(path, log_path=tmp_path / "log", env={"HSDP_INJECT_LOAD_DELAY": "0.2"},
                           extra_args=("--max-total-tokens", "64", "--api-key", KEY))
    try:
        def health_answers() -> bool:
            try:
                return server.client.get("/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(health_answers, 120, "/health answering 200 while the model loads")
        schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers=AUTH)
        statuses: collections.Counter = collections.Counter()
        server_errors = []
        loading = collections.Counter()
        _fuzz_pass(schema, server, EXAMPLES_WHILE_LOADING, loading, server_errors)
        assert server.client.get("/ready").status_code == 503 or any(code == 503 for *_, code in loading), \
            "the first pass never saw the load: it must run while the model loads"
        server.poll_ready()
        _fuzz_pass(schema, server, EXAMPLES_PER_OPERATION, statuses, server_errors)
        print("fuzz statuses while loading:", dict(loading), "then:", dict(statuses))
        assert not server_errors, server_errors[:3]
        assert sum(statuses.values()) >= 100
        # Not only rejections: generations ran too.
        assert sum(n for (method, _, code), n in statuses.items() if method == "POST" and code == 200) >= 10
        assert server.client.get("/health").status_code == 200
        r = server.client.post("/generate", json={"inputs": "still serving", "parameters": {"max_new_tokens": 2}},
                               headers=AUTH)
        assert r.status_code == 200
        assert server.client.post("/generate", json={"inputs": "no key"}).status_code == 401
    finally:
        server.stop()
