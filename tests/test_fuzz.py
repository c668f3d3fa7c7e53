"""Property-based fuzzing of the OpenAPI schema (schemathesis) against the running server: no 5xx, no crash."""

import collections

import pytest
from hypothesis import HealthCheck, given, settings

from tests.checkpoints import write_checkpoint
from tests.server_process import ServerProcess

EXAMPLES_PER_OPERATION = 25


@pytest.mark.timeout(500)
def test_schema_fuzz_finds_no_server_error(tmp_path):
    import schemathesis

    path = write_checkpoint(tmp_path / "llama", "llama")
    server = ServerProcess(path, log_path=tmp_path / "log", extra_args=("--max-total-tokens", "64"))
    try:
        server.poll_ready()
        schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
        statuses: collections.Counter = collections.Counter()
        server_errors = []
        for result in schema.get_all_operations():
            operation = result.ok()

            @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy())
            def fuzz(case):
                response = case.call(base_url=server.url, timeout=60)
                statuses[(case.method, case.path, response.status_code)] += 1
                if response.status_code >= 500:
                    server_errors.append((case.method, case.path, case.body, response.text[:300]))

            fuzz()
            assert server.proc.poll() is None, f"the server died: {server.log_tail()}"
        print("fuzz statuses:", dict(statuses))
        assert not server_errors, server_errors[:3]
        assert sum(statuses.values()) >= 100
        # Not only rejections: generations ran too.
        assert sum(n for (method, _, code), n in statuses.items() if method == "POST" and code == 200) >= 10
        assert server.client.get("/health").status_code == 200
        r = server.client.post("/generate", json={"inputs": "still serving", "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 200
    finally:
        server.stop()
