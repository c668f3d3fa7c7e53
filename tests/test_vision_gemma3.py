"""Gemma 3 images (``server.engine.multimodal``): an image's tokens attend to one another both ways,
inside a causal text, on sliding-window and full layers. A tiny random Gemma 3 on 2 ranks with its
tower sharded, every prompt cut into chunks of at most 5 tokens (``--max-batch-prefill-tokens 5``),
so that the scheduler must cut a chunk before an image or stretch it over one: greedy tokens and
their log-probabilities equal transformers' ``generate`` (the test model's image tokens seeing
only their past would move them by ~3e-3), for one and two images, an image request beside a
text-only one, a repeated image (a prefix hit), and TGI's ``![](url)``."""

from __future__ import annotations

import re

import pytest

from tests.server_process import ServerProcess
from tests.vision_checkpoints import assert_same_answer, at_once, image_data_url, image_parts, make_image, \
    reference_answer, reference_prompt_generate, served_answer, template_messages, vision_server, \
    write_gemma3_checkpoint

TOKENS = 8

_parts = image_parts


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    with vision_server(write_gemma3_checkpoint(root / "gemma3"), root, 5) as server:
        yield server


def _answer(server, content):
    return served_answer(server, content, TOKENS)


def _check(server, images, got, content=None):
    messages = template_messages(len(images)) if content is None else [{"role": "user", "content": content}]
    assert_same_answer(got, reference_answer(server.path, messages, images, TOKENS))


def test_one_image(served):
    image = make_image(1)
    _check(served, [image], _answer(served, _parts(image)))


def test_two_images(served):
    a, b = make_image(2), make_image(3, size=(80, 40))
    for pair in ((a, b), (b, a)):
        _check(served, list(pair), _answer(served, _parts(*pair)))


def test_image_request_beside_a_text_only_one(served):
    image = make_image(4)
    results = at_once(image=lambda: _answer(served, _parts(image)), text=lambda: _answer(served, "The quick brown fox"))
    _check(served, [image], results["image"])
    _check(served, [], results["text"], content="The quick brown fox")


def test_repeated_image_hits_the_prefix_cache(served):
    def hits():
        text = served.client.get("/metrics").text
        return float(re.search(r"^hsdp_prefix_cache_hit_tokens_total (\S+)$", text, re.M).group(1))

    image = make_image(5)
    first = _answer(served, _parts(image))
    before = hits()
    second = _answer(served, _parts(image))
    assert hits() - before >= 16  # past the image's 4 tokens
    assert_same_answer(second, first)
    _check(served, [image], second)


def test_tgi_markdown_image(served):
    image = make_image(6)
    want = reference_prompt_generate(served.path, "USER: <start_of_image> Describe it.\nASSISTANT:", [image], TOKENS)
    r = served.client.post("/generate", json={"inputs": "USER: ![](" + image_data_url(image) + ") Describe it.\nASSISTANT:",
                                              "parameters": {"max_new_tokens": TOKENS, "details": True}})
    assert r.status_code == 200, r.text
    assert [t["id"] for t in r.json()["details"]["tokens"]] == want


def test_chunks_hold_whole_images():
    """The scheduler cuts a chunk before an image it would end inside, or stretches it over one it starts in."""
    from server.engine.plan import ImageInput
    from server.engine.scheduler import _whole_images

    images = [ImageInput(b"", 8, 4, [], b""), ImageInput(b"", 20, 6, [], b"")]
    assert _whole_images(images, 0, 5) == 5  # before any image
    assert _whole_images(images, 5, 5) == 3  # would end at 10, inside 8..11: cut at 8
    assert _whole_images(images, 8, 2) == 4  # starts at the image: stretched to its end
    assert _whole_images(images, 9, 1) == 3  # starts inside it (a prefix hit): to its end
    assert _whole_images(images, 12, 10) == 8  # would end at 22, inside 20..25: cut at 20
    assert _whole_images(images, 12, 14) == 14  # ends at 26, past both


@pytest.mark.slow
def test_on_a_2x2_mesh_gathering(tmp_path):
    """4 ranks in 2 replicas of 2 shards, nothing resident: every unit gathers; the chunks still hold
    whole images and the masks still open them."""
    path = write_gemma3_checkpoint(tmp_path / "gemma3")
    server = ServerProcess(path, nproc=4, extra_args=("--kv-cache-memory", "8MiB", "--replicate-size", "2",
                                                      "--resident-units", "0", "--max-batch-prefill-tokens", "5"),
                           log_path=tmp_path / "server.log")
    server.path = path
    a, b = make_image(7), make_image(8, size=(80, 40))
    with server:
        for _ in range(2):  # each replica (or a prefix hit) answers the same
            _check(server, [a, b], _answer(server, _parts(a, b)))
