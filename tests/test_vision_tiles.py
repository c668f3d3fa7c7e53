"""Tiled images (``server.engine.multimodal``).

LLaVA-NeXT: an image as its whole at 28x28 and its tiles at the best of the model's resolutions, a
learned newline after each row of tile features, so that an image's tokens depend on its aspect. A
tiny random LLaVA-NeXT (hub tensor names) on 2 ranks with its tower sharded: greedy tokens and their
log-probabilities equal transformers' ``generate`` for wide, tall and square images, two images of
different tile counts in one prompt, and two requests whose images have different tile counts
encoded in one step (padded to the most tiles, each dropped by its size), and a prefix hit on a
repeated image.

Idefics3 and SmolVLM: an image as 56x56 tiles and then its whole, each tile's tokens between tile
markers (``<fake_token_around_image><row_1_col_2>``), so an image's tokens lie among text tokens,
and a pixel mask per tile. Each on 2 ranks with prompts cut into chunks of 7 tokens, so that chunks
end among an image's tiles: the same equalities, for one and two images.

LLaVA-OneVision: an image alone in its prompt tiled as LLaVA-NeXT's (its tiles pooled to
``anyres_max_1``), an image among others its whole image's features and a newline, as its chat
template passes a conversation's images to its processor. A tiny random one (SigLIP tower, Qwen2
text model) on 2 ranks, chunks of 7 tokens: the same equalities for one, two and three images, and
for the same image alone and among others in two requests sent together.

InternVL: an image cropped to 56x56 tiles by its aspect and its thumbnail, 4 tokens a tile between
``<img>`` and ``</img>``, every image's tiles in one flat batch of pixel values: the same equalities
for one and two images, chunks of 7 tokens.
"""

from __future__ import annotations

import re

import pytest

from tests.server_process import ServerProcess
from tests.vision_checkpoints import ENCODED_ALONE, assert_same_answer, at_once, image_parts, make_image, \
    reference_answer, served_answer, template_messages, vision_server, write_idefics3_checkpoint, \
    write_internvl_checkpoint, write_llava_next_checkpoint, write_llava_onevision_checkpoint

TOKENS = 8
WIDE, TALL, SQUARE = (60, 30), (30, 60), (50, 50)

_parts = image_parts


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava-next")
    with vision_server(write_llava_next_checkpoint(root / "llava-next"), root) as server:
        yield server


def _answer(server, content):
    return served_answer(server, content, TOKENS)


def _check(server, images, got):
    assert_same_answer(got, reference_answer(server.path, template_messages(len(images)), images, TOKENS))


@pytest.mark.parametrize("size", [WIDE, TALL, SQUARE], ids=["wide", "tall", "square"])
def test_one_image_of_each_aspect(served, size):
    image = make_image(1, size)
    _check(served, [image], _answer(served, _parts(image)))


def test_two_images_of_different_tile_counts(served):
    a, b = make_image(2, WIDE), make_image(3, SQUARE)
    _check(served, [a, b], _answer(served, _parts(a, b)))


def test_two_requests_encoded_in_one_step(served):
    images = [make_image(4, WIDE), make_image(5, SQUARE)]
    results = at_once(wide=lambda: _answer(served, _parts(images[0])), square=lambda: _answer(served, _parts(images[1])))
    for name, image in zip(("wide", "square"), images):
        _check(served, [image], results[name])


def test_repeated_image_hits_the_prefix_cache(served):
    def hits():
        text = served.client.get("/metrics").text
        return float(re.search(r"^hsdp_prefix_cache_hit_tokens_total (\S+)$", text, re.M).group(1))

    image = make_image(6, SQUARE)
    first = _answer(served, _parts(image))
    before = hits()
    assert_same_answer(_answer(served, _parts(image)), first)  # the hit's suffix sums in another order
    assert hits() - before >= 20  # the image's tokens (4 whole-image features, then 2x2 tiles' with newlines)


def test_images_of_different_tile_counts_encode_together_as_alone(tmp_path):
    """One rank's images of one step go through the encoder at once, padded to the most tiles."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from server.api.media import ImagePrompts
    from server.engine.multimodal import ImageEncoder

    path = write_llava_next_checkpoint(tmp_path / "llava-next")
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    prompts = ImagePrompts.load(path, AutoConfig.from_pretrained(path))
    inputs = [prompts.prompt("USER: <image>\nASSISTANT:", [make_image(7, size)])[1][0] for size in (WIDE, SQUARE)]
    assert inputs[0].shape[1] != inputs[1].shape[1]  # 3 and 5 tiles
    encoder = ImageEncoder(model, torch.device("cpu"))
    together = encoder.encode(inputs)
    for image, rows in zip(inputs, together):
        torch.testing.assert_close(rows, encoder.encode([image])[0], **ENCODED_ALONE)


def test_an_images_key_is_its_own_whatever_its_companions(tmp_path):
    """The processor pads a request's images to its most tiles; an image keeps only its own, so its
    key (and so its cache hits) does not depend on the images it came with."""
    from transformers import AutoConfig

    from server.api.media import ImagePrompts

    path = write_llava_next_checkpoint(tmp_path / "llava-next")
    prompts = ImagePrompts.load(path, AutoConfig.from_pretrained(path))
    wide, square = make_image(7, WIDE), make_image(8, SQUARE)
    alone = prompts.prompt("USER: <image>\nASSISTANT:", [wide])[1][0]
    beside = prompts.prompt("USER: <image><image>\nASSISTANT:", [wide, square])[1]
    assert beside[0].shape[1] < beside[1].shape[1]  # 3 tiles beside 5
    assert (beside[0].key, beside[0].shape, beside[0].pixels) == (alone.key, alone.shape, alone.pixels)


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def idefics(tmp_path_factory, request):
    root = tmp_path_factory.mktemp(request.param)
    with vision_server(write_idefics3_checkpoint(root / request.param, request.param), root, 7) as server:
        yield server


@pytest.mark.parametrize("images", [[(60, 40)], [(30, 90), (60, 40)]], ids=["one", "two"])
def test_tiles_among_markers_in_chunks(idefics, images):
    images = [make_image(10 + i, size) for i, size in enumerate(images)]
    _check(idefics, images, _answer(idefics, _parts(*images)))


def test_tiled_images_with_masks_encode_together_as_alone(tmp_path):
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from server.api.media import ImagePrompts
    from server.engine.multimodal import ImageEncoder

    path = write_idefics3_checkpoint(tmp_path / "idefics3")
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    prompts = ImagePrompts.load(path, AutoConfig.from_pretrained(path))
    _, inputs = prompts.prompt("USER: <image><image>\nASSISTANT:", [make_image(8, (30, 90)), make_image(9, (60, 40))])
    assert [image.shape[1] for image in inputs] == [3, 5] and all(image.length > image.count for image in inputs)
    encoder = ImageEncoder(model, torch.device("cpu"))
    together = encoder.encode(inputs)
    for image, rows in zip(inputs, together):
        torch.testing.assert_close(rows, encoder.encode([image])[0], **ENCODED_ALONE)


@pytest.mark.slow
def test_idefics3_on_a_2x2_mesh_gathering(tmp_path):
    path = write_idefics3_checkpoint(tmp_path / "idefics3")
    server = ServerProcess(path, nproc=4, extra_args=("--kv-cache-memory", "8MiB", "--replicate-size", "2",
                                                      "--resident-units", "0", "--max-batch-prefill-tokens", "7"),
                           log_path=tmp_path / "server.log")
    server.path = path
    images = [make_image(20, (30, 90)), make_image(21, (60, 40))]
    with server:
        for _ in range(2):
            _check(server, images, _answer(server, _parts(*images)))


# -- LLaVA-OneVision: an image tiled only alone in its prompt ----------------------------------------

@pytest.fixture(scope="module")
def onevision(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava-onevision")
    with vision_server(write_llava_onevision_checkpoint(root / "llava-onevision"), root, 7) as server:
        yield server


@pytest.mark.parametrize("sizes", [[TALL], [TALL, SQUARE, WIDE]], ids=["alone", "three"])
def test_onevision_tiles_an_image_only_alone_in_its_prompt(onevision, sizes):
    """Alone: its whole image, then its tiles unpadded and pooled to one tile's features, a newline
    a row; among others: each image's whole and a newline. Prompts cut into chunks of 7 tokens, so
    that chunks end inside images."""
    images = [make_image(30 + i, size) for i, size in enumerate(sizes)]
    got = _answer(onevision, _parts(*images))
    _check(onevision, images, got)
    assert got[2]["prompt_tokens"] > (7 if len(images) == 1 else 5 * len(images))


def test_onevision_image_alone_and_among_others_encoded_in_one_step(onevision):
    """The same image alone in one request and beside another in a second, sent together: its two
    embeddings differ, both requests are exact, and neither hits the other's cached blocks."""
    image, other = make_image(40, WIDE), make_image(41, SQUARE)
    results = at_once(alone=lambda: _answer(onevision, _parts(image)),
                      among=lambda: _answer(onevision, _parts(image, other)))
    _check(onevision, [image], results["alone"])
    _check(onevision, [image, other], results["among"])


def test_onevision_images_encode_together_as_alone_and_keep_their_keys(tmp_path):
    """An encoder call holding images alone in their prompts and images among others (one of them
    the only such image of the call) gives each the rows it gets in a call of its own; an image's key
    tells whether it was alone."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from server.api.media import ImagePrompts
    from server.engine.multimodal import ImageEncoder

    path = write_llava_onevision_checkpoint(tmp_path / "llava-onevision")
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    prompts = ImagePrompts.load(path, AutoConfig.from_pretrained(path))
    wide, square, tall = make_image(42, WIDE), make_image(43, SQUARE), make_image(44, TALL)
    [alone_wide] = prompts.prompt("USER: <image>\nASSISTANT:", [wide])[1]
    [alone_tall] = prompts.prompt("USER: <image>\nASSISTANT:", [tall])[1]
    among = prompts.prompt("USER: <image><image>\nASSISTANT:", [wide, square])[1]
    assert alone_wide.shape[1] == 3 and alone_tall.shape[1] == 3 and [i.shape[1] for i in among] == [1, 1]
    assert alone_wide.key != among[0].key and (alone_wide.count, among[0].count) == (7, 5)
    encoder = ImageEncoder(model, torch.device("cpu"))
    alone = {id(image): encoder.encode([image])[0] for image in (alone_wide, alone_tall)}
    pair = encoder.encode(among)
    for call in ([among[1], alone_wide, alone_tall], [alone_tall, *among], among[::-1]):
        for image, rows in zip(call, encoder.encode(call)):
            want = alone[id(image)] if id(image) in alone else pair[among.index(image)]
            torch.testing.assert_close(rows, want, **ENCODED_ALONE)


# -- InternVL: an image as its tiles and thumbnail, every image's tiles in one flat batch ------------

@pytest.fixture(scope="module")
def internvl(tmp_path_factory):
    root = tmp_path_factory.mktemp("internvl")
    with vision_server(write_internvl_checkpoint(root / "internvl"), root, 7) as server:
        yield server


@pytest.mark.parametrize("sizes", [[WIDE], [SQUARE], [TALL, WIDE]], ids=["wide", "square", "two"])
def test_internvl_tiles_in_chunks(internvl, sizes):
    """An image's tiles by its aspect (a wide one 2 tiles and its thumbnail, a square one itself
    alone), 4 tokens a tile between ``<img>`` and ``</img>``; chunks of 7 tokens end inside images."""
    images = [make_image(50 + i, size) for i, size in enumerate(sizes)]
    _check(internvl, images, _answer(internvl, _parts(*images)))


def test_internvl_images_encode_together_as_alone(tmp_path):
    """Images of different tile counts from one prompt and another, in one encoder call: each gets
    the rows it gets alone; an image's tiles and key are its own whatever its companions."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from server.api.media import ImagePrompts
    from server.engine.multimodal import ImageEncoder

    path = write_internvl_checkpoint(tmp_path / "internvl")
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    prompts = ImagePrompts.load(path, AutoConfig.from_pretrained(path))
    wide, square = make_image(52, WIDE), make_image(53, SQUARE)
    pair = prompts.prompt("USER: <IMG_CONTEXT><IMG_CONTEXT>\nASSISTANT:", [wide, square])[1]
    [alone] = prompts.prompt("USER: <IMG_CONTEXT>\nASSISTANT:", [wide])[1]
    assert [image.shape[0] for image in pair] == [3, 1] and [image.count for image in pair] == [12, 4]
    assert (alone.key, alone.shape, alone.pixels) == (pair[0].key, pair[0].shape, pair[0].pixels)
    encoder = ImageEncoder(model, torch.device("cpu"))
    together = encoder.encode([pair[1], alone, pair[0]])
    for image, rows in zip([pair[1], alone, pair[0]], together):
        torch.testing.assert_close(rows, encoder.encode([image])[0], **ENCODED_ALONE)
