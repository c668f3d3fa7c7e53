"""Images in, text out (``server.engine.multimodal``, ``server.api.media``): a tiny random Llava
(CLIP tower, projector, Llama) served on 2 ranks with its tower sharded, and on a 2x2 mesh and with
``--mm-encoder replicate``: greedy tokens equal transformers' ``generate`` on the same processor
inputs for one image, two images, an image request beside a text-only one, OpenAI's SDK sending
``image_url`` parts and TGI's ``![](url)``; a repeated image hits the prefix cache and a different
one does not (and still answers its own tokens); every media limit is a 400 naming its option;
remote URLs are refused without ``--allow-remote-media``; other image-text families are refused
before loading."""

from __future__ import annotations

import re

import pytest

from tests.server_process import ServerProcess
from tests.vision_checkpoints import QUESTION, at_once, image_data_url, image_parts, make_image, \
    reference_prompt_generate, reference_vlm_generate, write_llava_checkpoint

TOKENS = 8

_parts = image_parts


def _template_parts(count: int, text=QUESTION) -> list[dict]:
    return [*({"type": "image"} for _ in range(count)), {"type": "text", "text": text}]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    path = write_llava_checkpoint(root / "llava")
    media = root / "media"
    media.mkdir()
    make_image(3).save(media / "three.png")
    make_image(4, size=(400, 400)).save(root / "outside.png")
    return root, path, media


@pytest.fixture(scope="module")
def served(llava):
    root, path, media = llava
    args = ("--kv-cache-memory", "8MiB", "--kv-block-size", "4", "--max-images-per-request", "2",
            "--max-image-pixels", "100000", "--max-image-bytes", "300000", "--allowed-local-media-path", str(media))
    server = ServerProcess(path, extra_args=args, log_path=root / "server.log")
    server.path, server.root, server.media = path, root, media
    with server:
        yield server


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _chat(server, content, **extra) -> dict:
    r = server.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": content}], "max_tokens": TOKENS, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _hits(server) -> float:
    text = server.client.get("/metrics").text
    return float(re.search(r"^hsdp_prefix_cache_hit_tokens_total (\S+)$", text, re.M).group(1))


def _text(server, ids) -> str:
    return _tokenizer(server.path).decode(ids, skip_special_tokens=True)


def test_one_image_through_the_openai_sdk(served):
    import openai

    image = make_image(1)
    want = reference_vlm_generate(served.path, [{"role": "user", "content": _template_parts(1)}], [image], TOKENS)
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none")
    out = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=TOKENS, temperature=0,
                                         messages=[{"role": "user", "content": _parts(image)}])
    assert out.choices[0].message.content == _text(served, want)
    assert out.usage.prompt_tokens == 31  # the image's 4 tokens counted


def test_two_images_in_order(served):
    a, b = make_image(1), make_image(2)
    for pair in ((a, b), (b, a)):
        want = reference_vlm_generate(served.path, [{"role": "user", "content": _template_parts(2)}], pair, TOKENS)
        assert _chat(served, _parts(*pair))["choices"][0]["message"]["content"] == _text(served, want)


def test_tgi_markdown_image_gives_transformers_tokens(served):
    image = make_image(5)
    prompt = "USER: ![](" + image_data_url(image) + ") Describe it.\nASSISTANT:"
    want = reference_prompt_generate(served.path, "USER: <image> Describe it.\nASSISTANT:", [image], TOKENS)
    r = served.client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": TOKENS,
                                                                                "details": True}})
    assert r.status_code == 200, r.text
    assert [t["id"] for t in r.json()["details"]["tokens"]] == want


def test_local_file_under_the_allowed_path(served):
    from PIL import Image

    image = Image.open(served.media / "three.png").convert("RGB")
    want = reference_vlm_generate(served.path, [{"role": "user", "content": _template_parts(1)}], [image], TOKENS)
    content = [{"type": "image_url", "image_url": {"url": f"file://{served.media / 'three.png'}"}},
               {"type": "text", "text": QUESTION}]
    assert _chat(served, content)["choices"][0]["message"]["content"] == _text(served, want)


def test_image_request_beside_a_text_only_one(served):
    image = make_image(6)
    want_image = reference_vlm_generate(served.path, [{"role": "user", "content": _template_parts(1)}], [image],
                                        TOKENS)
    want_text = reference_vlm_generate(served.path, [{"role": "user", "content": "The quick brown fox"}], [],
                                       TOKENS)
    def answer(content):
        return _chat(served, content)["choices"][0]["message"]["content"]

    results = at_once(image=lambda: answer(_parts(image)), text=lambda: answer("The quick brown fox"))
    assert results == {"image": _text(served, want_image), "text": _text(served, want_text)}


def test_prefix_cache_keys_images_by_content(served):
    first, other = make_image(7), make_image(8)
    want = {id(i): reference_vlm_generate(served.path, [{"role": "user", "content": _template_parts(1)}], [i],
                                          TOKENS) for i in (first, other)}
    _chat(served, _parts(first))
    before = _hits(served)
    assert _chat(served, _parts(first))["choices"][0]["message"]["content"] == _text(served, want[id(first)])
    repeated = _hits(served) - before
    assert repeated >= 28  # every full block of the 31-token prompt: the image's among them
    before = _hits(served)
    assert _chat(served, _parts(other))["choices"][0]["message"]["content"] == _text(served, want[id(other)])
    # "USER: " fills one block of 4; the next holds the image's first tokens: another image misses there
    assert _hits(served) - before == 4


def test_an_image_after_other_text_comes_from_the_embedding_cache(served):
    import re as _re

    def images(how):
        text = served.client.get("/metrics").text
        return float(_re.search(r'^hsdp_images_total{how="%s"} (\S+)$' % how, text, _re.M).group(1))

    image = make_image(13)
    for lead in ("Look at this: ", "And now this one, please: "):  # the prefix cache misses before the image
        content = [{"type": "text", "text": lead}, *_parts(image)]
        want = reference_vlm_generate(served.path, [{"role": "user", "content": [
            {"type": "text", "text": lead}, *_template_parts(1)]}], [image], TOKENS)
        before = images("encoded"), images("cached")
        assert _chat(served, content)["choices"][0]["message"]["content"] == _text(served, want)
        after = images("encoded"), images("cached")
    # the second time on the same rank (its "USER: " block is cached there): the embeddings, not the pixels
    assert (after[0] - before[0], after[1] - before[1]) == (0, 1)


def test_the_image_cache_book_keeps_the_most_recent_within_its_rows():
    from server.engine.multimodal import ImageCacheBook
    from server.engine.plan import ImageInput

    def image(key, count):
        return ImageInput(key, 0, count, [1], b"pixels")

    book = ImageCacheBook(ranks=2, capacity=10)
    forget = []
    assert not book.take(0, image(b"a", 4), forget).cached and not book.take(0, image(b"b", 4), forget).cached
    sent = book.take(0, image(b"a", 4), forget)  # held: no pixels travel, and it is now the most recent
    assert sent.cached and sent.pixels == b"" and forget == []
    assert not book.take(1, image(b"a", 4), forget).cached  # another rank's cache is its own
    book.take(0, image(b"c", 4), forget)  # 12 rows > 10: the least recent (b) goes
    assert forget == [b"b"] and book.take(0, image(b"a", 4), forget).cached
    forget.clear()
    book.take(0, image(b"huge", 11), forget)  # larger than the whole cache: not held, the rest kept
    assert forget == [b"huge"] and book.take(0, image(b"a", 4), forget).cached
    forget.clear()
    book.take(0, image(b"d", 4), forget)  # a (most recent) and d held, c let go ...
    assert forget == [b"c"]
    book.take(0, image(b"c", 4), forget)  # ... and back in the same step: the rank must keep it
    assert b"c" not in forget and book.take(0, image(b"c", 4), []).cached
    forget = {}
    book.clear(forget)  # a pause clearing caches: each rank is told what it holds
    assert forget == {0: [b"d", b"c"], 1: [b"a"]} and not book.take(1, image(b"a", 4), []).cached
    forget = []
    zero = ImageCacheBook(ranks=1, capacity=0)
    assert not zero.take(0, image(b"a", 1), forget).cached and forget == [b"a"]  # --mm-embedding-cache 0


def test_an_embedding_row_is_counted_in_the_served_dtype(llava):
    import torch
    from transformers import AutoConfig

    from server.engine.multimodal import embedding_row_bytes

    config = AutoConfig.from_pretrained(llava[1])  # saved in float32
    hidden = config.get_text_config().hidden_size
    assert embedding_row_bytes(config, torch.bfloat16) == 2 * hidden
    assert embedding_row_bytes(config, torch.float32) == 4 * hidden


@pytest.mark.parametrize("case, option", [
    ("count", "--max-images-per-request"),
    ("pixels", "--max-image-pixels"),
    ("bytes", "--max-image-bytes"),
    ("outside", "--allowed-local-media-path"),
    ("remote", "--allow-remote-media"),
])
def test_media_limits_are_400s_naming_the_option(served, case, option):
    from PIL import Image

    big = Image.frombytes("RGB", (400, 400), bytes(400 * 400 * 3))
    urls = {
        "count": [image_data_url(make_image(i)) for i in range(3)],
        "pixels": [image_data_url(big)],
        "bytes": [image_data_url(make_image(9, size=(330, 330)))],  # random pixels: a PNG of ~330 kB
        "outside": [f"file://{served.root / 'outside.png'}"],
        "remote": ["https://example.com/cat.png"],
    }[case]
    content = [*({"type": "image_url", "image_url": {"url": u}} for u in urls), {"type": "text", "text": "?"}]
    r = served.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                          "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == option, r.text
    assert option in r.json()["error"]["message"]
    assert _chat(served, "still serving?")["choices"]  # the server goes on


def test_placeholders_must_match_images(served):
    r = served.client.post("/generate", json={"inputs": "USER: <image> hi", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 400 and "placeholder" in r.json()["error"], r.text
    r = served.client.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": [{"type": "text", "text": "<image>"}] + _parts(make_image(1))}], "max_tokens": 2})
    assert r.status_code == 400 and "placeholders" in r.json()["error"]["message"], r.text


def test_a_placeholder_is_never_generated(served):
    """``logit_bias`` all for the image token: a generated placeholder would count as an image's row
    in a step with another sequence's image (and break the model's count), so it is never chosen,
    while an image request runs beside it."""
    image_token = _tokenizer(served.path).convert_tokens_to_ids("<image>")
    results = at_once(
        image=lambda: _chat(served, _parts(make_image(9)))["choices"][0],
        biased=lambda: _chat(served, "The quick brown fox", logprobs=True,
                             logit_bias={str(image_token): 100})["choices"][0])
    assert set(results) == {"image", "biased"}
    tokens = [entry["token"] for entry in results["biased"]["logprobs"]["content"]]
    assert len(tokens) == TOKENS and "<image>" not in tokens, tokens


@pytest.mark.slow
def test_an_image_its_processor_miscounts_fails_alone(llava):
    """A processor at odds with its model (one placeholder fewer than the tower's rows): the image's
    request fails with the reason, and the group goes on serving."""
    import json
    import shutil

    root, path, _ = llava
    broken = root / "miscounted"
    shutil.copytree(path, broken)
    config_path = broken / "processor_config.json"
    config = json.loads(config_path.read_text())
    config["num_additional_image_tokens"] = 0
    config_path.write_text(json.dumps(config))
    with ServerProcess(str(broken), extra_args=("--kv-cache-memory", "8MiB"),
                       log_path=root / "server-miscounted.log") as server:
        r = server.client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": _parts(make_image(1))}], "max_tokens": 2})
        assert r.status_code == 500 and "placeholders" in r.json()["error"]["message"], r.text
        text = _chat(server, "The quick brown fox")["choices"][0]["message"]["content"]
        assert text
        assert server.client.get("/health").status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize("nproc, args", [
    (4, ("--replicate-size", "2", "--resident-units", "0")),  # every unit gathers: an idle rank gathers alone
    (2, ("--mm-encoder", "replicate", "--mm-embedding-cache", "0")),  # and no image's embeddings kept
], ids=["2x2-mesh-gathering", "encoder-replicated"])
def test_other_meshes_and_a_replicated_encoder(llava, nproc, args):
    root, path, _ = llava
    a, b = make_image(1), make_image(2)
    want = reference_vlm_generate(path, [{"role": "user", "content": _template_parts(2)}], (a, b), TOKENS)
    with ServerProcess(path, nproc=nproc, extra_args=("--kv-cache-memory", "8MiB", *args),
                       log_path=root / f"server-{nproc}.log") as server:
        server.path = path
        for _ in range(2):  # each replica (or a prefix hit) answers the same
            assert _chat(server, _parts(a, b))["choices"][0]["message"]["content"] == _text(server, want)
        # an image request and a text one at once: one rank encodes while its peer only gathers
        results = at_once(image=lambda: _chat(server, _parts(make_image(12))),
                          text=lambda: _chat(server, "The quick brown fox"))
        assert len(results) == 2


def _idle_encodes(rank, world_size, path):
    """A rank's blank encodes for a step with no image of its own (``ImageEncoder.encode([])``):
    with every unit resident in the host's shared copy, and with nothing resident."""
    import torch

    from loaders import load_hsdp_model
    from server.engine.multimodal import ImageEncoder
    from shard_engine import HSDPInferenceConfig, set_resident_units

    loaded = load_hsdp_model(path, HSDPInferenceConfig(), dtype=torch.float32)
    encoder = ImageEncoder(loaded.model, torch.device("cpu"))
    calls = []
    features = encoder._features
    encoder._features = lambda *a, **k: calls.append(1) or features(*a, **k)
    out = {}
    for mode, count, shared in (("shared", -1, True), ("none", 0, False)):
        set_resident_units(loaded.model, count, shared=shared)
        before = len(calls)
        assert encoder.encode([]) == []
        out[mode] = len(calls) - before
    return {"sharded": encoder.sharded, **out}


def test_an_idle_rank_encodes_a_blank_only_where_the_encoder_gathers(llava, tmp_path):
    """Every rank calls the encoder in a step that encodes: one with no image of its own encodes a
    blank image only where its encoder units gather (their all-gathers must match the others');
    with every unit resident (the CPU default's shared copy) nothing runs a collective, and it
    encodes nothing."""
    from tests.dist import run_ranks, values

    _, path, _ = llava
    for got in values(run_ranks(_idle_encodes, 2, tmp_path, path, timeout=180)):
        assert got == {"sharded": True, "shared": 0, "none": 1}, got


def test_other_image_text_families_are_refused_before_loading():
    from transformers import PaliGemmaConfig

    from server.engine.capability import UnsupportedModelError, check_servable

    with pytest.raises(UnsupportedModelError, match="image-text families served are gemma3, idefics3, internvl, "
                       "llava, llava_next, llava_onevision, mistral3, qwen2_5_vl, qwen2_vl, qwen3_5, qwen3_5_moe, "
                       "qwen3_vl, smolvlm"):
        check_servable(PaliGemmaConfig())
