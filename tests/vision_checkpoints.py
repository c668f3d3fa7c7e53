"""Small real vision-language checkpoints written with transformers: random weights, their processors, images made here.

``write_llava_checkpoint`` saves a tiny ``LlavaForConditionalGeneration`` (a 2-layer CLIP vision tower
over 28x28 images in 14x14 patches, so 4 patch features a picture once the CLS feature is dropped;
``tests.checkpoints.make_config("llama")``'s text model) with a ``LlavaProcessor`` whose tokenizer is
the test tokenizer plus the special token ``<image>``. One image expands to 4 ``<image>`` tokens.
Everything loads offline through ``AutoProcessor`` and ``AutoModelForImageTextToText``.

``write_qwen_vl_checkpoint`` saves a tiny Qwen2-VL or Qwen2.5-VL (a 2-block vision transformer over
14x14 patches, 2x2 of them merged into one token, images resized to 56..84 pixels a side so that
their grids differ; a 3-layer text model with the 3-D rope ``mrope_section`` [2, 3, 3]) with the
Qwen tokens ``<|vision_start|><|image_pad|><|vision_end|>``. Its processor is saved as its parts (the
image processor, the tokenizer, the chat template): transformers builds a Qwen-VL processor only
with torchvision, which this machine's torch has no build of; :func:`server.api.media.load_processor`
assembles it from them.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import json
import os
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
    return _rename(name, HUB_PREFIXES)


def _rename(name: str, prefixes: dict) -> str:
    for prefix, hub_prefix in prefixes.items():
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


# LLaVA-NeXT: 28x28 tiles of an image resized to the best of these sizes, after the whole image at 28x28
NEXT_PINPOINTS = [[28, 56], [56, 28], [56, 56]]
NEXT_HUB_PREFIXES = {**HUB_PREFIXES, "model.image_newline": "image_newline"}


def write_llava_next_checkpoint(path, *, seed: int = 0, max_shard_size="40KB") -> str:
    """Save a random-weight LLaVA-NeXT (the Llava's tower, projector and text model, the image's
    tiles at :data:`NEXT_PINPOINTS`, a learned newline after each row of tile features) under the
    hub's tensor names, and its ``LlavaNextProcessor``. An image's tokens depend on its aspect."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    base = make_processor()
    processor = LlavaNextProcessor(
        image_processor=LlavaNextImageProcessorPil(
            size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
            image_grid_pinpoints=NEXT_PINPOINTS, do_pad=True),
        tokenizer=base.tokenizer, patch_size=PATCH_SIZE, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE, image_token=IMAGE_TOKEN,
    )
    llava = make_llava_config(len(base.tokenizer), base.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
    config = LlavaNextConfig(
        vision_config=llava.vision_config, text_config=llava.text_config, image_token_id=llava.image_token_id,
        image_grid_pinpoints=NEXT_PINPOINTS, projector_hidden_act="gelu", vision_feature_layer=-2,
        vision_feature_select_strategy="default", tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    path = _save_with_newline(LlavaNextForConditionalGeneration, config, path, seed, max_shard_size)
    processor.save_pretrained(path)
    return path


def _save_with_newline(model_class, config, path, seed: int, max_shard_size) -> str:
    """A LLaVA-NeXT-like model of ``config``, random (its projector drawn at :data:`PROJECTOR_STD`, its
    learned newline at 1), saved under the hub's tensor names (:data:`NEXT_HUB_PREFIXES`)."""
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for linear in (model.model.multi_modal_projector.linear_1, model.model.multi_modal_projector.linear_2):
            linear.weight.normal_(0.0, PROJECTOR_STD)
        model.model.image_newline.normal_(0.0, 1.0)
    state_dict = {_rename(k, NEXT_HUB_PREFIXES): v for k, v in model.state_dict().items()}
    path = str(path)
    model.save_pretrained(path, state_dict=state_dict, max_shard_size=max_shard_size, save_original_format=False)
    return path


# LLaVA-OneVision: SigLIP's every patch feature (no CLS), the tiles of an image alone in its prompt at
# the best of these sizes, pooled back to at most one tile's features (``anyres_max_1``: a 2x2 tiling is
# interpolated to one tile's 2x2 rows, as 3x3 of anyres_max_9 would be to 9 tiles')
ONEVISION_PINPOINTS = [[28, 56], [56, 28], [56, 56]]
ONEVISION_ASPECT = "anyres_max_1"


def write_llava_onevision_checkpoint(path, *, seed: int = 0, max_shard_size="40KB") -> str:
    """Save a random-weight LLaVA-OneVision (a 2-layer SigLIP tower over 28x28 tiles in 14x14 patches,
    every patch feature kept; a gelu projector; a Qwen2 text model; a learned newline) under the hub's
    tensor names, with its ``LlavaOnevisionProcessor``. An image alone in its prompt is tiled at
    :data:`ONEVISION_PINPOINTS` (its tokens depend on its aspect, pooled to :data:`ONEVISION_ASPECT`);
    among several, each is its whole image's 4 features and a newline."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, SiglipVisionConfig
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import \
        LlavaOnevisionImageProcessorPil

    tok = make_processor().tokenizer
    image_processor = LlavaOnevisionImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, image_grid_pinpoints=ONEVISION_PINPOINTS, do_pad=True)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    config = LlavaOnevisionConfig(
        vision_config=vision, text_config=make_config("qwen2", len(tok)),
        image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN), image_grid_pinpoints=ONEVISION_PINPOINTS,
        vision_aspect_ratio=ONEVISION_ASPECT, projector_hidden_act="gelu", vision_feature_layer=-1,
        vision_feature_select_strategy="full", tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )
    path = _save_with_newline(LlavaOnevisionForConditionalGeneration, config, path, seed, max_shard_size)
    save_processor_parts(path, image_processor, tok, "LlavaOnevisionProcessor", num_image_tokens=IMAGE_TOKENS_PER_IMAGE,
                         vision_feature_select_strategy="full", vision_aspect_ratio=ONEVISION_ASPECT,
                         image_token=IMAGE_TOKEN)
    return path


def save_processor_parts(path: str, image_processor, tok, processor_class: str | None = None, **settings) -> None:
    """A processor saved as its parts, as the hub ships those whose video processor transformers
    builds only with torchvision: the image processor, the tokenizer and, with ``processor_class``,
    ``processor_config.json`` holding the processor's own ``settings``
    (:func:`server.api.media.load_processor` assembles it from them)."""
    image_processor.save_pretrained(path)
    tok.save_pretrained(path)
    if processor_class is not None:
        with open(os.path.join(path, "processor_config.json"), "w") as f:
            json.dump({"processor_class": processor_class, **settings}, f)


INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>",
                   "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
INTERNVL_TILE = 56  # a tile's side: 4x4 patches of 14, pixel-shuffled to 2x2 = 4 tokens a tile
INTERNVL_MAX_TILES = 4


def write_internvl_checkpoint(path, *, seed: int = 0, max_shard_size="40KB") -> str:
    """Save a random-weight InternVL (the InternVL3 ``-hf`` layout: a 2-layer InternViT over 56x56
    tiles in 14x14 patches, CLS dropped, pixel-shuffled 2x2 into 4 tokens a tile, an MLP projector, a
    Qwen2 text model) with its processor's parts (GOT-OCR2's image processor, cropping an image to
    1..:data:`INTERNVL_MAX_TILES` tiles by its aspect and adding its thumbnail; the tokenizer with
    ``<img>``, ``</img>`` and ``<IMG_CONTEXT>``): an image is ``<img>``, 4 ``<IMG_CONTEXT>`` a tile,
    ``</img>``, its tiles' pixel values concatenated with the other images'."""
    from transformers import AutoTokenizer, InternVLConfig, InternVLForConditionalGeneration, InternVLVisionConfig
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer().save_pretrained(tmp)
        tok = AutoTokenizer.from_pretrained(tmp, extra_special_tokens=INTERNVL_TOKENS)
    tok.chat_template = CHAT_TEMPLATE.replace("'<image>'", "'<IMG_CONTEXT>'")
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": INTERNVL_TILE, "width": INTERNVL_TILE}, crop_to_patches=True, min_patches=1,
        max_patches=INTERNVL_MAX_TILES)
    vision = InternVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=[INTERNVL_TILE, INTERNVL_TILE], patch_size=[PATCH_SIZE, PATCH_SIZE])
    seq = (INTERNVL_TILE // PATCH_SIZE) ** 2 // 4
    config = InternVLConfig(
        vision_config=vision, text_config=make_config("qwen2", len(tok)), image_seq_length=seq,
        image_token_id=tok.convert_tokens_to_ids(INTERNVL_TOKENS["context_image_token"]),
        vision_feature_layer=-1, vision_feature_select_strategy="default", tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(config)
    with torch.no_grad():
        for linear in (model.model.multi_modal_projector.linear_1, model.model.multi_modal_projector.linear_2):
            linear.weight.normal_(0.0, PROJECTOR_STD)
    path = str(path)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    save_processor_parts(path, image_processor, tok, "InternVLProcessor", image_seq_length=seq)
    return path


GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


def write_gemma3_checkpoint(path, *, seed: int = 0, max_shard_size="40KB") -> str:
    """Save a random-weight Gemma 3 (a 2-layer SigLIP tower over 56x56 images in 14x14 patches,
    pooled to 4 image tokens; a 4-layer text model whose layers alternate a sliding window of 8 and
    full attention) and its ``Gemma3Processor``: the template's ``<start_of_image>`` becomes
    ``<start_of_image>`` + 4 ``<image_soft_token>`` + ``<end_of_image>``, and the model attends over
    an image's 4 tokens both ways."""
    from transformers import AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer().save_pretrained(tmp)
        tok = AutoTokenizer.from_pretrained(tmp, extra_special_tokens=GEMMA3_TOKENS)
    template = CHAT_TEMPLATE.replace("'<image>'", "'<start_of_image>'")
    tok.chat_template = template
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 56, "width": 56}),
                                tokenizer=tok, chat_template=template, image_seq_length=4)
    config = Gemma3Config(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=256,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=56, patch_size=14),
        mm_tokens_per_image=4, image_token_index=tok.image_token_id, boi_token_index=tok.boi_token_id,
        eoi_token_index=tok.convert_tokens_to_ids(GEMMA3_TOKENS["eoi_token"]))
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():  # image features that outweigh the text's
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, PROJECTOR_STD * 4)
    path = str(path)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    processor.save_pretrained(path)
    return path


def write_idefics3_checkpoint(path, model_type: str = "idefics3", *, seed: int = 0, max_shard_size="40KB") -> str:
    """Save a random-weight Idefics3 (``model_type`` "idefics3") or SmolVLM ("smolvlm"): a 2-layer
    SigLIP-like tower over 56x56 tiles in 14x14 patches, pixel-shuffled 2x2 into 4 tokens a tile; the
    image resized to at most 112 pixels a side and cut into 56x56 tiles, then the whole image at 56x56
    too, each tile's 4 ``<image>`` tokens between ``<fake_token_around_image>`` and a
    ``<row_i_col_j>`` (or ``<global-img>``) marker; ``make_config("llama")``'s text model; its
    processor (SmolVLM's assembled from its parts without torchvision)."""
    from transformers import AutoModelForImageTextToText, Idefics3Config, Idefics3Processor, SmolVLMConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    base = make_processor()
    tok = base.tokenizer
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN, "<fake_token_around_image>",
                                                          "<global-img>", "<end_of_utterance>"]})
    sizes = dict(do_image_splitting=True, size={"longest_edge": 112}, max_image_size={"longest_edge": 56})
    if model_type == "idefics3":
        image_processor, config_class = Idefics3ImageProcessorPil(**sizes), Idefics3Config
    elif model_type == "smolvlm":
        image_processor, config_class = SmolVLMImageProcessorPil(**sizes), SmolVLMConfig
    else:
        raise ValueError(model_type)
    config = config_class(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=56, patch_size=14),
        text_config=make_config("llama", len(tok)).to_dict(), scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN), tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).to(torch.float32)
    with torch.no_grad():
        model.model.connector.modality_projection.proj.weight.normal_(0.0, PROJECTOR_STD)
    path = str(path)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    if model_type == "idefics3":
        Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=4,
                          chat_template=CHAT_TEMPLATE).save_pretrained(path)
    else:  # SmolVLMProcessor wants a video processor (torchvision): its parts, as the hub ships them
        save_processor_parts(path, image_processor, tok, "SmolVLMProcessor", image_seq_len=4)
        with open(f"{path}/chat_template.jinja", "w") as f:
            f.write(CHAT_TEMPLATE)
    return path


# Qwen's template: each image part a vision span whose one pad the processor repeats per merged patch.
QWEN_IMAGE_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
QWEN_PIXELS = (56 * 56, 84 * 84)  # the image processor's min_pixels and max_pixels


def make_qwen_vl_config(model_type: str, tok):
    """A Qwen2-VL or Qwen2.5-VL config: text hidden 64 (4 heads of 16, 2 KV heads, 3 layers, the 3-D
    rope's sections [2, 3, 3]); vision hidden 32, 2 blocks, 14x14 patches, 2x2 merged (Qwen2.5-VL's
    second block attends over the whole image, its first within 28-pixel windows); Qwen3-VL and Qwen3.5
    with 16x16 patches, Qwen3.5's 4 text layers gated delta-nets and attention in turn (and experts:
    "qwen3_5_moe")."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    token = tok.convert_tokens_to_ids
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rope_parameters={"rope_type": "default", "rope_theta": 100.0, "mrope_section": [2, 3, 3]},
                bos_token_id=0, eos_token_id=0, pad_token_id=0)
    vision = dict(depth=2, num_heads=4, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if model_type == "qwen2_vl":
        cls, vision = Qwen2VLConfig, dict(vision, embed_dim=32, hidden_size=64, mlp_ratio=2)
    elif model_type == "qwen2_5_vl":
        cls, vision = Qwen2_5_VLConfig, dict(vision, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                                             window_size=28, fullatt_block_indexes=[1])
    elif model_type == "qwen3_vl":  # 16x16 patches, learned position embeddings, deepstack after block 0
        text["rope_parameters"] = dict(text["rope_parameters"], mrope_interleaved=True)
        cls, vision = Qwen3VLConfig, dict(vision, patch_size=16, hidden_size=32, intermediate_size=64,
                                          out_hidden_size=64, num_position_embeddings=64, deepstack_visual_indexes=[0])
        text.update(head_dim=16)
    elif model_type in ("qwen3_5", "qwen3_5_moe"):  # Qwen3-VL's tower; gated delta-net and attention layers
        from transformers import Qwen3_5Config, Qwen3_5MoeConfig

        text["rope_parameters"] = dict(text["rope_parameters"], mrope_interleaved=True, partial_rotary_factor=1.0)
        text.update(head_dim=16, num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_conv_kernel_dim=4)
        if model_type == "qwen3_5_moe":  # and experts
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
        cls = Qwen3_5MoeConfig if model_type == "qwen3_5_moe" else Qwen3_5Config
        vision = dict(vision, patch_size=16, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                      num_position_embeddings=64)
    else:
        raise ValueError(model_type)
    return cls(text_config=text, vision_config=vision, image_token_id=token("<|image_pad|>"),
               video_token_id=token("<|video_pad|>"), vision_start_token_id=token("<|vision_start|>"),
               vision_end_token_id=token("<|vision_end|>"), tie_word_embeddings=False)


# Qwen2-VL and Qwen2.5-VL checkpoints on the hub name the text model ``model.`` and the vision tower
# ``visual.``; Qwen3-VL's use transformers' own names
QWEN_HUB_PREFIXES = {"model.language_model.": "model.", "model.visual.": "visual.", "lm_head.": "lm_head."}


def write_qwen_vl_checkpoint(path, model_type: str = "qwen2_vl", *, seed: int = 0, max_shard_size="40KB") -> str:
    """Save a random-weight Qwen2-VL (``model_type`` "qwen2_vl"), Qwen2.5-VL ("qwen2_5_vl"), Qwen3-VL
    ("qwen3_vl") or Qwen3.5 ("qwen3_5", "qwen3_5_moe": transformers' own names too) under the hub's tensor names (:data:`QWEN_HUB_PREFIXES`, Qwen3-VL's transformers' own), its image processor,
    tokenizer and chat template."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer().save_pretrained(tmp)
        tok = AutoTokenizer.from_pretrained(tmp)
    tok.add_special_tokens({"additional_special_tokens": list(QWEN_IMAGE_TOKENS)})
    tok.chat_template = QWEN_CHAT_TEMPLATE
    config = make_qwen_vl_config(model_type, tok)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).to(torch.float32)
    with torch.no_grad():  # image features that outweigh the text's, as the Llava's projector (PROJECTOR_STD)
        for name, param in model.model.visual.named_parameters():
            if "merger" in name and name.endswith("weight") and param.dim() == 2:
                param.normal_(0.0, PROJECTOR_STD)
    state_dict = model.state_dict()
    if model_type not in ("qwen3_vl", "qwen3_5", "qwen3_5_moe"):
        state_dict = {_rename(k, QWEN_HUB_PREFIXES): v for k, v in state_dict.items()}
    path = str(path)
    model.save_pretrained(path, state_dict=state_dict, max_shard_size=max_shard_size, save_original_format=False)
    patch = config.vision_config.patch_size
    scale = (patch / 14) ** 2  # Qwen3-VL's 16-pixel patches: the same grids as 14-pixel ones
    image_processor = Qwen2VLImageProcessorPil(min_pixels=int(QWEN_PIXELS[0] * scale),
                                               max_pixels=int(QWEN_PIXELS[1] * scale), patch_size=patch,
                                               temporal_patch_size=2, merge_size=2)
    save_processor_parts(path, image_processor, tok)
    with open(f"{path}/chat_template.jinja", "w") as f:
        f.write(QWEN_CHAT_TEMPLATE)
    return path


@functools.lru_cache(maxsize=4)
def _reference_model(path: str):
    from transformers import AutoModelForImageTextToText

    from server.api.media import load_processor

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return model, load_processor(path)


def _sample(model, images):
    """``images`` as the processor takes one prompt's: a list, or (LLaVA-OneVision, whose processor
    tiles an image only alone in its sample) one sample's list, as transformers' chat template
    passes a conversation's images."""
    from server.engine.multimodal import image_family

    family = image_family(model.config)
    images = list(images)
    return None if not images else [images] if family is not None and family.tiled_alone else images


def reference_vlm_generate(path, messages, images, max_new_tokens: int = 16) -> list[int]:
    """Greedy new token ids from transformers' own unsharded model for chat ``messages`` showing
    ``images`` (in the order their image parts appear): the reference we must match."""
    _, processor = _reference_model(str(path))
    prompt = processor.tokenizer.apply_chat_template(messages, chat_template=processor.chat_template,
                                                     add_generation_prompt=True, tokenize=False)
    return reference_prompt_generate(path, prompt, images, max_new_tokens)


@torch.no_grad()
def reference_prompt_generate(path, prompt: str, images, max_new_tokens: int = 16) -> list[int]:
    """Greedy new token ids from transformers' own unsharded model for ``prompt`` (an image
    placeholder per image) and ``images``."""
    model, processor = _reference_model(str(path))
    inputs = processor(text=prompt, images=_sample(model, images), return_tensors="pt")
    out = model.generate(
        **inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=processor.tokenizer.pad_token_id,
    )
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@torch.no_grad()
def reference_vlm_logprobs(path, messages, images, max_new_tokens: int = 16) -> tuple[list[int], list[float]]:
    """Greedy new token ids from transformers' own unsharded model for chat ``messages`` showing
    ``images``, and each one's log-probability (of the raw scores): where a model's positions
    matter less than its images (a random one), its log-probabilities still tell them apart."""
    model, processor = _reference_model(str(path))
    prompt = processor.tokenizer.apply_chat_template(messages, chat_template=processor.chat_template,
                                                     add_generation_prompt=True, tokenize=False)
    inputs = processor(text=prompt, images=_sample(model, images), return_tensors="pt")
    out = model.generate(
        **inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=processor.tokenizer.pad_token_id, output_logits=True, return_dict_in_generate=True,
    )
    ids = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs = [torch.log_softmax(scores[0].float(), -1)[token].item() for scores, token in zip(out.logits, ids)]
    return ids, logprobs


# -- served answers against the reference ----------------------------------------------------------

QUESTION = "What is this?"
TOLERANCE = 1e-4  # on log-probabilities, served against transformers'


def image_parts(*images, text: str = QUESTION) -> list[dict]:
    """OpenAI chat content: each image as a data: URL part, then ``text``."""
    return [*({"type": "image_url", "image_url": {"url": image_data_url(i)}} for i in images),
            {"type": "text", "text": text}]


def template_messages(count: int, text: str = QUESTION) -> list[dict]:
    """The chat messages transformers' template renders for ``count`` images and ``text``."""
    return [{"role": "user", "content": [*({"type": "image"} for _ in range(count)), {"type": "text", "text": text}]}]


def served_answer(server, content, max_tokens: int) -> tuple[list[str], list[float], dict]:
    """A greedy chat answer's tokens, their log-probabilities and its usage."""
    r = server.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
        "logprobs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    entries = body["choices"][0]["logprobs"]["content"]
    return [e["token"] for e in entries], [e["logprob"] for e in entries], body["usage"]


def reference_answer(path, messages, images, max_tokens: int) -> tuple[list[str], list[float]]:
    """transformers' greedy answer as ``served_answer`` gives it: tokens as text, log-probabilities."""
    from transformers import AutoTokenizer

    ids, logprobs = reference_vlm_logprobs(path, messages, images, max_tokens)
    tok = AutoTokenizer.from_pretrained(path)
    return [tok.decode([i]) for i in ids], logprobs


@contextlib.contextmanager
def vision_server(path, root, chunk: int | None = None, *args: str):
    """A module's shared server of the checkpoint at ``path`` on 2 ranks (8 MiB of KV blocks of 4 tokens;
    prompts cut into chunks of ``chunk`` tokens where given), its log under ``root``; ``server.path``
    the checkpoint, for the reference."""
    from tests.server_process import ServerProcess

    chunking = ("--max-batch-prefill-tokens", str(chunk)) if chunk else ()
    server = ServerProcess(path, extra_args=("--kv-cache-memory", "8MiB", "--kv-block-size", "4", *chunking, *args),
                           log_path=root / "server.log")
    server.path = path
    with server:
        yield server



ENCODED_ALONE = {"rtol": 1e-4, "atol": 1e-5}
"""How close an image's rows encoded beside others are to its rows encoded alone (float32): a batched
product may round in another order (oneDNN blocks a matmul by its row count: 3.5e-5 relative seen on
a Xeon host, none on an EPYC one), while a companion leaking into an image changes its rows
wholesale."""


def assert_same_answer(got, want, tolerance: float = TOLERANCE) -> None:
    (tokens, logprobs), (want_tokens, want_logprobs) = got[:2], want[:2]
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < tolerance, (logprobs, want_logprobs)


def at_once(**calls) -> dict:
    """Each call (a function of nothing) in a thread of its own, all started together: their
    results by name (a call that raised has none)."""
    import threading

    results = {}
    threads = [threading.Thread(target=lambda n=name, f=call: results.__setitem__(n, f())) for name, call in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


PIXTRAL_TOKENS = {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}
PIXTRAL_LONGEST = 56  # the image processor's longest edge: 4 patches of 14 at most a side


def write_pixtral_checkpoint(path, model_type: str = "llava", *, seed: int = 0, max_shard_size="40KB") -> str:
    """Save a random-weight model with a Pixtral vision tower (2 layers over images resized to at
    most 56 pixels a side, each side a multiple of the 14-pixel patch: its 2-D rope places a patch by
    its row and column, and every image attends only within itself): Pixtral-12B's layout (``llava``:
    a patch a token, the ``full`` features of the last layer, a Llama text model) or Mistral 3's
    (``mistral3``: 2x2 patches merged into a token by its projector, a Mistral text model). Its
    processor is saved as its parts (PIL image processor, tokenizer with ``[IMG]``, ``[IMG_BREAK]``
    and ``[IMG_END]``, ``processor_config.json``): an image is its rows of ``[IMG]`` tokens, each row
    ended by ``[IMG_BREAK]``, the last by ``[IMG_END]``."""
    from transformers import AutoTokenizer, LlavaConfig, LlavaForConditionalGeneration, MistralConfig, \
        Mistral3Config, Mistral3ForConditionalGeneration, PixtralVisionConfig
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer().save_pretrained(tmp)
        tok = AutoTokenizer.from_pretrained(tmp, extra_special_tokens=PIXTRAL_TOKENS)
    tok.chat_template = CHAT_TEMPLATE.replace("'<image>'", "'[IMG]'")
    image_token_id = tok.convert_tokens_to_ids(PIXTRAL_TOKENS["image_token"])
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 head_dim=8, image_size=PIXTRAL_LONGEST, patch_size=PATCH_SIZE)
    torch.manual_seed(seed)
    if model_type == "mistral3":
        merge = 2
        text = MistralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                             tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        config = Mistral3Config(vision_config=vision, text_config=text, image_token_index=image_token_id,
                                projector_hidden_act="gelu", vision_feature_layer=-1, spatial_merge_size=merge,
                                tie_word_embeddings=False)
        model = Mistral3ForConditionalGeneration(config)
    elif model_type == "llava":
        merge = 1
        config = LlavaConfig(vision_config=vision, text_config=make_config("llama", len(tok)),
                             image_token_id=image_token_id, projector_hidden_act="gelu", vision_feature_layer=-1,
                             vision_feature_select_strategy="full", tie_word_embeddings=False)
        model = LlavaForConditionalGeneration(config)
    else:
        raise ValueError(model_type)
    with torch.no_grad():
        for linear in (model.model.multi_modal_projector.linear_1, model.model.multi_modal_projector.linear_2):
            linear.weight.normal_(0.0, PROJECTOR_STD)
    path = str(path)
    model.to(torch.float32).save_pretrained(path, max_shard_size=max_shard_size)
    save_processor_parts(path, PixtralImageProcessorPil(size={"longest_edge": PIXTRAL_LONGEST}, patch_size=PATCH_SIZE),
                         tok, "PixtralProcessor", patch_size=PATCH_SIZE, spatial_merge_size=merge, **PIXTRAL_TOKENS)
    return path
