"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 images (``server.engine.multimodal.GridRope``): a tiny random
Qwen2-VL (hub tensor names, its processor assembled from its parts) and Qwen3-VL (deepstack: image
features added in its first decoder layer too) each on 2 ranks with its tower sharded, and a
Qwen2.5-VL (window attention in its tower) on a 2x2 mesh and with ``--mm-encoder replicate``.

Each answer's tokens equal transformers' ``generate`` on the same processor inputs, and so do their
log-probabilities (to 1e-4): the test model's rope base is small, so a token placed at its index
instead of its grid position moves them by ~1e-2 where its greedy tokens may not move at all.
Images of different sizes give different grids; two images in one prompt; an image request beside a
text-only one in the same steps (3-D positions packed with 1-D ones); a repeated image computes its
suffix after a prefix hit at the grid's positions; TGI's ``![](url)`` becomes the vision span.
"""

from __future__ import annotations

import pytest
import torch

from tests.server_process import ServerProcess
from tests.vision_checkpoints import QUESTION, assert_same_answer, at_once, image_data_url, image_parts, make_image, \
    reference_answer, served_answer, template_messages, write_qwen_vl_checkpoint

TOKENS = 8
WIDE, TALL = (60, 40), (40, 80)  # resized to 56x84 and 56x84 turned: grids [1, 4, 6] and [1, 6, 4]

_parts = image_parts


def _template(*images, text=QUESTION) -> list[dict]:
    return template_messages(len(images), text)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-vl")
    return root, {t: write_qwen_vl_checkpoint(root / t, t) for t in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")}


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])
def served(checkpoints, request):
    root, paths = checkpoints
    server = ServerProcess(paths[request.param], extra_args=("--kv-cache-memory", "8MiB", "--kv-block-size", "4"),
                           log_path=root / f"server-{request.param}.log")
    server.path = paths[request.param]
    with server:
        yield server


def _answer(server, content):
    return served_answer(server, content, TOKENS)


def _expect(server, images, messages=None) -> tuple[list[str], list[float]]:
    return reference_answer(server.path, messages or _template(*images), images, TOKENS)


_assert_same = assert_same_answer


@pytest.mark.parametrize("size", [WIDE, TALL], ids=["wide", "tall"])
def test_one_image_matches_transformers(served, size):
    image = make_image(1, size)
    got = _answer(served, _parts(image))
    _assert_same(got, _expect(served, [image]))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(served.path)
    text = tok.apply_chat_template(_template(image), add_generation_prompt=True, tokenize=False)
    assert got[2]["prompt_tokens"] == len(tok(text, add_special_tokens=False).input_ids) - 1 + 6  # its 6 merged patches


def test_two_images_of_different_grids_in_order(served):
    a, b = make_image(2, WIDE), make_image(3, TALL)
    for pair in ((a, b), (b, a)):
        _assert_same(_answer(served, _parts(*pair)), _expect(served, list(pair)))


def test_image_request_beside_a_text_only_one(served):
    image = make_image(4, WIDE)
    want = {"image": _expect(served, [image]),
            "text": _expect(served, [], [{"role": "user", "content": "The quick brown fox"}])}
    results = at_once(image=lambda: _answer(served, _parts(image)), text=lambda: _answer(served, "The quick brown fox"))
    for name in want:
        _assert_same(results[name], want[name])


def test_repeated_image_hits_and_its_suffix_keeps_the_grid_positions(served):
    import re

    from transformers import AutoTokenizer

    def hits():
        text = served.client.get("/metrics").text
        return float(re.search(r"^hsdp_prefix_cache_hit_tokens_total (\S+)$", text, re.M).group(1))

    tok = AutoTokenizer.from_pretrained(served.path)
    text = tok.apply_chat_template(_template(None, text="Describe it in detail."), add_generation_prompt=True,
                                   tokenize=False)
    image_start = tok(text, add_special_tokens=False).input_ids.index(tok.convert_tokens_to_ids("<|image_pad|>"))
    image = make_image(5, TALL)
    want = _expect(served, [image], _template(image, text="Describe it in detail."))
    _assert_same(_answer(served, _parts(image, text="Describe it in detail.")), want)
    before = hits()
    _assert_same(_answer(served, _parts(image, text="Describe it in detail.")), want)
    assert hits() - before >= image_start + 6  # past the image: the suffix computed after it at its grid positions
    other = make_image(6, TALL)  # the same grid, other pixels: no hit on the image's blocks
    before = hits()
    _assert_same(_answer(served, _parts(other, text="Describe it in detail.")),
                 _expect(served, [other], _template(other, text="Describe it in detail.")))
    assert hits() - before <= image_start


def test_tgi_markdown_image_is_the_vision_span(served):
    from tests.vision_checkpoints import reference_prompt_generate

    image = make_image(7, WIDE)
    want = reference_prompt_generate(served.path, "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
                                     "Describe it.<|im_end|>\n<|im_start|>assistant\n", [image], TOKENS)
    prompt = "<|im_start|>user\n![](" + image_data_url(image) + ")Describe it.<|im_end|>\n<|im_start|>assistant\n"
    r = served.client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": TOKENS,
                                                                                "details": True}})
    assert r.status_code == 200, r.text
    assert [t["id"] for t in r.json()["details"]["tokens"]] == want


def test_an_image_the_processor_refuses_is_a_400(served):
    """Qwen-VL's resize refuses an aspect ratio over 200: the request's fault, not the server's."""
    r = served.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": _parts(make_image(1, (1, 250)))}], "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages" and "processor refuses the image" in error["message"], error
    assert served.client.get("/health").status_code == 200


def test_positions_of_a_recomputed_sequence_continue_its_prompts(checkpoints):
    """A sequence re-added after a preemption brings its generated tokens: the model's rope index of
    the whole gives them the positions the prompt's offset gave them while they were generated."""
    from transformers import AutoModelForImageTextToText

    from server.engine.multimodal import GridRope
    from server.engine.plan import SamplingParams, SequenceAdd
    from server.engine.rank import _Sequence

    _, paths = checkpoints
    model = AutoModelForImageTextToText.from_pretrained(paths["qwen2_vl"], dtype=torch.float32)
    rope = GridRope(model)
    pad = model.config.image_token_id
    prompt = [5, 6, *[pad] * 6, 7, 8, *[pad] * 6, 9]
    grids = [[2, 6, 1, 4, 6], [10, 6, 1, 6, 4]]
    first = _Sequence(SequenceAdd(1, 0, prompt, SamplingParams(max_new_tokens=4), [], image_grids=grids), rope)
    again = _Sequence(SequenceAdd(1, 0, prompt + [11, 12, 13], SamplingParams(max_new_tokens=4), [], 3, image_grids=grids), rope)
    assert torch.equal(first.rope_positions(0, len(prompt) + 3), again.rope_positions(0, len(prompt) + 3))
    # each image's 6 tokens (2x3 or 3x2 merged patches) take 3 positions: the grid's longer side
    assert first.rope_delta == again.rope_delta == -6
    assert torch.equal(first.rope_positions(len(prompt), 2), torch.tensor([[len(prompt) - 6, len(prompt) - 5]] * 3))


@pytest.mark.slow
@pytest.mark.parametrize("nproc, args", [
    (4, ("--replicate-size", "2", "--resident-units", "0")),  # every unit gathers: an idle rank gathers alone
    (2, ("--mm-encoder", "replicate")),
], ids=["2x2-mesh-gathering", "encoder-replicated"])
def test_qwen2_5_vl_on_other_meshes(checkpoints, nproc, args):
    root, paths = checkpoints
    server = ServerProcess(paths["qwen2_5_vl"], nproc=nproc, extra_args=("--kv-cache-memory", "8MiB", *args),
                           log_path=root / f"server-2.5-{nproc}.log")
    server.path = paths["qwen2_5_vl"]
    a, b = make_image(8, WIDE), make_image(9, TALL)
    with server:
        want = _expect(server, [a, b])
        for _ in range(2):  # each replica (or a prefix hit) answers the same
            _assert_same(_answer(server, _parts(a, b)), want)
        # an image request and a text one at once: one rank encodes while its peer only gathers
        results = at_once(image=lambda: _answer(server, _parts(make_image(10, WIDE))),
                          text=lambda: _answer(server, "The quick brown fox"))
        assert len(results) == 2


@pytest.mark.slow
def test_compiled_decode_takes_the_grid_offset(checkpoints):
    """``--compile decode``: a decode step's positions are its tokens' indices plus each sequence's
    offset, one row a token, so the compiled graph serves image sequences as text ones."""
    root, paths = checkpoints
    server = ServerProcess(paths["qwen2_vl"], extra_args=("--kv-cache-memory", "8MiB", "--compile", "decode"),
                           log_path=root / "server-compiled.log")
    server.path = paths["qwen2_vl"]
    with server:
        assert "decode forward compiled" in server.log_tail(1000)
        for images in ([make_image(11, WIDE)], [make_image(12, TALL), make_image(13, WIDE)]):
            _assert_same(_answer(server, _parts(*images)), _expect(server, images))


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_images_with_its_stateful_layers(tmp_path, family):
    """Qwen3.5 and Qwen3.5-MoE (their configs also map to a text-only class: built image-text here,
    ``loaders.skeleton.builds_image_text``): Qwen3-VL's tower, gated delta-net layers whose state is
    each sequence's own (``server.engine.state``) beside attention (and experts); on 2 ranks, the
    tower sharded. One image, two of different grids, and an image request beside a text-only one at
    once: each answer equal to transformers' image-text ``generate``."""
    path = write_qwen_vl_checkpoint(tmp_path / family, family)
    server = ServerProcess(path, extra_args=("--kv-cache-memory", "8MiB", "--kv-block-size", "4"),
                           log_path=tmp_path / "server.log")
    server.path = path
    a, b, c = make_image(1, WIDE), make_image(2, TALL), make_image(4, WIDE)
    want = {"one": _expect(server, [a]), "two": _expect(server, [a, b]), "image": _expect(server, [c]),
            "text": _expect(server, [], [{"role": "user", "content": "The quick brown fox"}])}
    with server:
        _assert_same(_answer(server, _parts(a)), want["one"])
        _assert_same(_answer(server, _parts(a, b)), want["two"])
        results = at_once(image=lambda: _answer(server, _parts(c)), text=lambda: _answer(server, "The quick brown fox"))
        info = server.client.get("/info").json()
    for name in ("image", "text"):
        _assert_same(results[name], want[name])
    assert info["kv_cache"]["state_bytes_per_sequence"] > 0
