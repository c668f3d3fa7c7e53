"""Images of their own sizes: a Pixtral vision tower (``server.engine.multimodal``'s ``sized`` family).

Pixtral-12B (a LLaVA whose tower is Pixtral's) and Mistral 3 (the same tower, 2x2 patches merged
into a token by its projector) resize an image to at most 56 pixels a side here, each side a
multiple of the patch (14; 28 merged), and place its tokens as its rows of ``[IMG]``, each row
ended by ``[IMG_BREAK]`` and the last by ``[IMG_END]``: an image's tokens lie among text tokens.
The processor pads a request's images to the largest; each image keeps its own pixels (its key
and cache hits do not depend on its companions), and a step's images are padded again to the
largest among them, the tower dropping each one's padding patches by its size.

Each family on 2 ranks with its tower sharded and prompts cut into chunks of 7 tokens (chunks end
among an image's rows): greedy tokens and their log-probabilities equal transformers' ``generate``
for wide, tall and two images, and for two requests of different sizes encoded in one step. In
process: the processor this server builds where transformers' needs torchvision equals
transformers' own, and the encoder's mixed calls equal images encoded alone (a Mistral 3 image of
one token too, which transformers' own call cannot encode alone).
"""

from __future__ import annotations

import sys
import types

import pytest

from tests.vision_checkpoints import ENCODED_ALONE, assert_same_answer, at_once, image_parts, make_image, \
    reference_answer, served_answer, template_messages, vision_server, write_pixtral_checkpoint

TOKENS = 8
WIDE, TALL, SMALL = (60, 30), (30, 60), (20, 20)


def _check(server, images, got):
    assert_same_answer(got, reference_answer(server.path, template_messages(len(images)), images, TOKENS))


@pytest.fixture(scope="module", params=["llava", "mistral3"])
def served(tmp_path_factory, request):
    root = tmp_path_factory.mktemp(f"pixtral-{request.param}")
    with vision_server(write_pixtral_checkpoint(root / request.param, request.param), root, 7) as server:
        yield server


@pytest.mark.parametrize("sizes", [[WIDE], [TALL], [WIDE, TALL]], ids=["wide", "tall", "two"])
def test_images_of_their_own_sizes_in_chunks(served, sizes):
    images = [make_image(10 + i, size) for i, size in enumerate(sizes)]
    _check(served, images, served_answer(served, image_parts(*images), TOKENS))


def test_two_requests_of_different_sizes_encoded_in_one_step(served):
    images = [make_image(20, WIDE), make_image(21, TALL)]
    results = at_once(wide=lambda: served_answer(served, image_parts(images[0]), TOKENS),
                      tall=lambda: served_answer(served, image_parts(images[1]), TOKENS))
    for name, image in zip(("wide", "tall"), images):
        _check(served, [image], results[name])


@pytest.fixture(scope="module")
def transformers_pixtral_processor():
    """transformers' own ``PixtralProcessor`` class, imported past its module's import of the
    torchvision image processor (whose one function it uses only to count tokens from sizes)."""
    import transformers.models.pixtral.image_processing_pil_pixtral as pil

    name = "transformers.models.pixtral.image_processing_pixtral"
    saved = {key: sys.modules.get(key) for key in (name, "transformers.models.pixtral.processing_pixtral")}
    stand_in = types.ModuleType(name)
    stand_in.get_resize_output_image_size = pil.get_resize_output_image_size
    sys.modules[name] = stand_in
    sys.modules.pop("transformers.models.pixtral.processing_pixtral", None)
    try:
        from transformers.models.pixtral.processing_pixtral import PixtralProcessor
    finally:
        for key, module in saved.items():
            if module is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = module
    return PixtralProcessor


@pytest.mark.parametrize("model_type", ["llava", "mistral3"])
def test_the_processor_built_without_torchvision_equals_transformers(tmp_path, model_type,
                                                                     transformers_pixtral_processor):
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer

    from server.api.media import load_processor

    path = write_pixtral_checkpoint(tmp_path / model_type, model_type)
    ours = load_processor(path)
    theirs = transformers_pixtral_processor.from_pretrained(path)
    assert type(ours).__name__ == "PixtralProcessor" and type(ours) is not transformers_pixtral_processor
    assert type(ours.image_processor) is type(AutoImageProcessor.from_pretrained(path))
    assert ours.tokenizer.get_vocab() == AutoTokenizer.from_pretrained(path).get_vocab()
    text = "USER: [IMG]a[IMG]\nASSISTANT:"
    images = [make_image(30, WIDE), make_image(31, (50, 40))]
    got, want = ours(text=[text], images=images, return_tensors="pt"), theirs(text=[text], images=images,
                                                                           return_tensors="pt")
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
    assert ours.chat_template == theirs.chat_template


@pytest.mark.parametrize("model_type", ["llava", "mistral3"])
def test_sized_images_encode_together_as_alone_and_keep_their_keys(tmp_path, model_type):
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from server.api.media import ImagePrompts
    from server.engine.multimodal import ImageEncoder

    path = write_pixtral_checkpoint(tmp_path / model_type, model_type)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    prompts = ImagePrompts.load(path, AutoConfig.from_pretrained(path))
    wide, tall, small = make_image(40, WIDE), make_image(41, TALL), make_image(42, SMALL)
    beside = prompts.prompt("USER: [IMG][IMG][IMG]\nASSISTANT:", [wide, tall, small])[1]
    alone = [prompts.prompt("USER: [IMG]\nASSISTANT:", [image])[1][0] for image in (wide, tall, small)]
    assert [i.shape for i in beside] == [i.shape for i in alone] == [[1, 3, 28, 56], [1, 3, 56, 28], [1, 3, 28, 28]]
    assert [i.key for i in beside] == [i.key for i in alone]  # the request's padding is not an image's
    encoder = ImageEncoder(model, torch.device("cpu"))
    together = encoder.encode(beside)
    for image, rows in zip(beside, together):
        assert rows.shape[1] == image.count
        torch.testing.assert_close(rows, encoder.encode([image])[0], **ENCODED_ALONE)
    assert beside[2].count == (1 if model_type == "mistral3" else 4)  # one merged patch: alone with the blank
