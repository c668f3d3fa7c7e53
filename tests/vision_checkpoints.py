"""Small real vision-language checkpoints written with transformers: random weights, their processors, images made here.

``write_llava_checkpoint`` saves a tiny ``LlavaForConditionalGeneration`` (a 2-layer CLIP vision tower
over 28x28 images in 14x14 patches, so 4 patch features a picture once the CLS feature is dropped;
``tests.checkpoints.make_config("llama")``'s text model) with a ``LlavaProcessor`` whose tokenizer is
the test tokenizer plus the special token ``<image>``. One image expands to 4 ``<image>`` tokens.
Everything loads offline through ``AutoProcessor`` and ``AutoModelForImageTextToText``.
"""

from __future__ import annotations

import base64
import functools
import io
import tempfile

import numpy as np
import torch

from tests.checkpoints import make_config, tokenizer

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 28
PATCH_SIZE = 14
IMAGE_TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2

# "USER: <image>What is this?\nASSISTANT:"-style prompts, one line a message; ``content`` is a string or
# a list of parts, each {"type": "text", "text": ...} or an image ({"type": "image"}, or OpenAI's
# "image_url"), which renders as one "<image>" for the processor to expand.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ message['role'] | upper + ': ' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{ '<image>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'ASSISTANT:' }}{%- endif -%}"
)


def vlm_tokenizer():
    """A fresh copy of the test tokenizer (the cached one is left alone) with ``<image>`` added."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer().save_pretrained(tmp)
        tok = AutoTokenizer.from_pretrained(tmp)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_processor():
    """The ``LlavaProcessor`` saved next to the model: 28x28 CLIP preprocessing, 4 image tokens an image."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    image_processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_resize=True, do_center_crop=True, do_rescale=True, do_normalize=True, do_convert_rgb=True,
    )
    return LlavaProcessor(
        image_processor=image_processor, tokenizer=vlm_tokenizer(), patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE, image_token=IMAGE_TOKEN,
    )


def make_llava_config(vocab_size: int, image_token_id: int):
    """A ``LlavaConfig``: CLIP vision tower (hidden 32, 2 layers, 4 heads, 28x28 images, 14x14 patches),
    the penultimate layer's patch features (CLS dropped), a gelu projector and ``make_config("llama")``."""
    from transformers import CLIPVisionConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32,
    )
    return LlavaConfig(
        vision_config=vision, text_config=make_config("llama", vocab_size), image_token_id=image_token_id,
        image_seq_length=IMAGE_TOKENS_PER_IMAGE, projector_hidden_act="gelu", vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )


# Real Llava checkpoints on the hub (llava-hf/*) name their tensors this way; transformers renames them
# on load to its module names (the left-hand prefixes).
HUB_PREFIXES = {
    "model.language_model.": "language_model.model.",
    "lm_head.": "language_model.lm_head.",
    "model.vision_tower.": "vision_tower.vision_model.",
    "model.multi_modal_projector.": "multi_modal_projector.",
}

# The projector's weights are drawn with this std (not the 0.02 of every other weight), so that image
# features outweigh the text embeddings and two different images give different greedy tokens at once.
PROJECTOR_STD = 0.2


def write_llava_checkpoint(path, *, seed: int = 0, max_shard_size="40KB", dtype=torch.float32,
                           names: str = "hub") -> str:
    """Save a random-weight Llava model and its processor to ``path``; returns ``path``.

    ``names="hub"`` writes the tensor names real Llava checkpoints use (``HUB_PREFIXES``' values:
    ``language_model.model.layers.0...``, ``language_model.lm_head.weight``,
    ``vision_tower.vision_model...``, ``multi_modal_projector...``); ``names="transformers"``
    writes transformers' module names (``model.language_model.layers.0...``, ``lm_head.weight``,
    ``model.vision_tower...``, ``model.multi_modal_projector...``). Both load the same model.
    """
    from transformers import LlavaForConditionalGeneration

    processor = make_processor()
    tok = processor.tokenizer
    config = make_llava_config(len(tok), tok.convert_tokens_to_ids(IMAGE_TOKEN))
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():
        for linear in (model.model.multi_modal_projector.linear_1, model.model.multi_modal_projector.linear_2):
            linear.weight.normal_(0.0, PROJECTOR_STD)
    model = model.to(dtype)
    state_dict = model.state_dict()
    if names == "hub":
        state_dict = {_hub_name(k): v for k, v in state_dict.items()}
    elif names != "transformers":
        raise ValueError(names)
    path = str(path)
    model.save_pretrained(path, state_dict=state_dict, max_shard_size=max_shard_size, save_original_format=False)
    processor.save_pretrained(path)
    return path


def _hub_name(name: str) -> str:
    for prefix, hub_prefix in HUB_PREFIXES.items():
        if name.startswith(prefix):
            return hub_prefix + name[len(prefix):]
    raise ValueError(name)


def make_image(seed: int, size=(40, 32)):
    """A deterministic RGB image of ``size`` (width, height) with random pixels."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    width, height = size
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def image_data_url(image, fmt: str = "PNG") -> str:
    """``image`` encoded as a ``data:image/<fmt>;base64,...`` URL."""
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


@functools.lru_cache(maxsize=4)
def _reference_model(path: str):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(path)


def reference_vlm_generate(path, messages, images, max_new_tokens: int = 16) -> list[int]:
    """Greedy new token ids from transformers' own unsharded model for chat ``messages`` showing
    ``images`` (in the order their image parts appear): the reference we must match."""
    _, processor = _reference_model(str(path))
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return reference_prompt_generate(path, prompt, images, max_new_tokens)


@torch.no_grad()
def reference_prompt_generate(path, prompt: str, images, max_new_tokens: int = 16) -> list[int]:
    """Greedy new token ids from transformers' own unsharded model for ``prompt`` (an image
    placeholder per image) and ``images``."""
    model, processor = _reference_model(str(path))
    inputs = processor(text=prompt, images=list(images) or None, return_tensors="pt")
    out = model.generate(
        **inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=processor.tokenizer.pad_token_id,
    )
    return out[0, inputs["input_ids"].shape[1]:].tolist()
