"""Benchmark a request with one 448x448 image: the vision tower sharded against replicated, and
transformers' ``generate``, side by side in one run; and a repeated image's time to first token.

    python -m benchmarks.vision [--family llava|qwen2_vl] [--nproc 2] [--resident-units 0] [--repeats 3]
                                [--tokens 16] [--out FILE]

The model (``--family``): a random-weight LLaVA (a CLIP ViT-B/14 tower at 448x448: 12 layers of
768, 1024 image tokens; a projector; a Llama of 8 layers of 1024), or a random-weight Qwen2-VL (a
ViT of 12 layers of 768 over 14x14 patches, 2x2 merged: 256 image tokens at 448x448; a Qwen2 of 8
layers of 1024 with the 3-D rope), float32, written once under ``~/.cache/hsdp-serve/bench-<family>``.

For each ``--mm-encoder`` mode a server of ``--nproc`` CPU ranks (``--resident-units 0`` unless
given: each rank holds only its shards, as a model too large for one device would be served):
per request with a new image, the time to first token and the whole request; then the same image
again (its blocks in the prefix cache: issue 30's target is a time to first token <= 0.4x the
first's); then the same image after other text (the prefix cache misses at the image; its rank's
embedding cache, ``--mm-embedding-cache``, holds it); each rank's checkpoint bytes read and shard
bytes held (``/info``). transformers' unsharded model (``generate`` with the processor's inputs,
the same image and tokens, all cores) is the reference. Every figure is printed with its dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

TARGET_REPEAT = 0.4
CACHE = os.path.expanduser("~/.cache/hsdp-serve/bench-{family}")
QUESTION = "Describe this picture in detail."


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def write_model(family: str) -> str:
    """The benchmark's model of ``family`` (random weights, the test tokenizer and processor), once."""
    path = CACHE.format(family=family)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    if family == "qwen2_vl":
        return _write_qwen2_vl(path)
    import torch
    from transformers import CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig, \
        LlavaForConditionalGeneration, LlavaProcessor

    from tests.vision_checkpoints import CHAT_TEMPLATE, IMAGE_TOKEN, vlm_tokenizer

    tok = vlm_tokenizer()
    image_token_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                       num_attention_heads=12, image_size=448, patch_size=14),
        text_config=LlamaConfig(vocab_size=len(tok), hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096,
                                tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0),
        image_token_id=image_token_id, image_seq_length=1024, projector_hidden_act="gelu",
        vision_feature_layer=-2, vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 448}, crop_size={"height": 448, "width": 448}),
        tokenizer=tok, patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE)
    tmp = path + ".tmp"
    model.save_pretrained(tmp, max_shard_size="200MB")
    processor.save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def _write_qwen2_vl(path: str) -> str:
    import torch
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tests.checkpoints import tokenizer
    from tests.vision_checkpoints import QWEN_CHAT_TEMPLATE, QWEN_IMAGE_TOKENS

    with tempfile.TemporaryDirectory() as scratch:
        tokenizer().save_pretrained(scratch)
        tok = AutoTokenizer.from_pretrained(scratch)
    tok.add_special_tokens({"additional_special_tokens": list(QWEN_IMAGE_TOKENS)})
    tok.chat_template = QWEN_CHAT_TEMPLATE
    token = tok.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [8, 12, 12]},
                         bos_token_id=0, eos_token_id=0, pad_token_id=0),
        vision_config=dict(depth=12, embed_dim=768, hidden_size=1024, num_heads=12, mlp_ratio=4, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"),
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).eval()
    tmp = path + ".tmp"
    model.save_pretrained(tmp, max_shard_size="200MB")
    Qwen2VLImageProcessorPil(min_pixels=448 * 448, max_pixels=448 * 448).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, "chat_template.jinja"), "w") as f:
        f.write(QWEN_CHAT_TEMPLATE)
    os.replace(tmp, path)
    return path


def _stream(client, body: dict) -> tuple[float, float, str]:
    """(time to first token, whole request, text) of one streamed chat request."""
    start, first, text = time.perf_counter(), None, []
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            delta = json.loads(line[5:])["choices"][0]["delta"].get("content")
            if delta:
                first = first or time.perf_counter()
                text.append(delta)
    return first - start, time.perf_counter() - start, "".join(text)


def serve(model: str, mode: str, nproc: int, images: list, tokens: int, tmp: str, resident: str = "0") -> dict:
    from tests.server_process import ServerProcess
    from tests.vision_checkpoints import image_data_url

    args = ("--kv-cache-memory", "256MiB", "--resident-units", resident, "--mm-encoder", mode,
            "--max-body-bytes", str(16 << 20))
    with ServerProcess(model, nproc=nproc, extra_args=args, log_path=os.path.join(tmp, f"{mode}.log")) as s:
        def body(image, lead=None):
            return {"max_tokens": tokens, "temperature": 0, "messages": [{"role": "user", "content": [
                *([{"type": "text", "text": lead}] if lead else []),
                {"type": "image_url", "image_url": {"url": image_data_url(image)}},
                {"type": "text", "text": QUESTION}]}]}

        _stream(s.client, body(images[-1]))  # warm-up: first-call costs out of the figures
        new, again, after = [], [], []
        for i, image in enumerate(images[:-1]):
            new.append(_stream(s.client, body(image)))
            again.append(_stream(s.client, body(image)))
            # after other text: the prefix cache misses at the image; its rank's embedding cache holds it
            after.append(_stream(s.client, body(image, lead=f"Question {i}, about a picture I took:")))
            log(f"{mode}: new image ttft {new[-1][0]:.3f} s, request {new[-1][1]:.3f} s; "
                f"same image again ttft {again[-1][0]:.3f} s; after other text ttft {after[-1][0]:.3f} s")
        info = s.client.get("/info").json()
    ranks = info["ranks"]
    return {
        "mode": mode, "dtype": info["model_dtype"],
        "ttft_new_s": statistics.median(t for t, _, _ in new), "request_new_s": statistics.median(r for _, r, _ in new),
        "ttft_repeat_s": statistics.median(t for t, _, _ in again),
        "ttft_after_other_text_s": statistics.median(t for t, _, _ in after),
        "text": new[0][2],
        "load_bytes_read": [r.get("load_bytes_read") for r in ranks],
        "shard_bytes": [(r.get("memory") or {}).get("shards") for r in ranks],
        "pss_bytes": [(r.get("memory") or {}).get("pss") for r in ranks],
    }


def reference(model: str, images: list, tokens: int) -> dict:
    import torch
    from transformers import AutoModelForImageTextToText

    from server.api.media import load_processor

    processor = load_processor(model)
    net = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    prompt = processor.tokenizer.apply_chat_template(messages, chat_template=processor.chat_template,
                                                     add_generation_prompt=True, tokenize=False)
    times, text = [], None
    for image in images:
        inputs = processor(text=prompt, images=[image], return_tensors="pt")
        start = time.perf_counter()
        with torch.no_grad():
            out = net.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                               pad_token_id=0)
        times.append(time.perf_counter() - start)
        text = text or processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return {"request_s": statistics.median(times[1:] or times), "text": text, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    from tests.vision_checkpoints import make_image

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=("llava", "qwen2_vl"), default="llava")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--resident-units", default="0", help="the servers' --resident-units (0: every unit gathers)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--out", help="also write the summary JSON here")
    args = parser.parse_args(argv)
    model = write_model(args.family)
    images = [make_image(100 + i, size=(448, 448)) for i in range(args.repeats + 1)]
    ref = reference(model, images, args.tokens)
    log(f"transformers generate: {ref['request_s']:.3f} s a request ({ref['threads']} threads)")
    with tempfile.TemporaryDirectory(prefix="bench-vision-") as tmp:
        modes = {mode: serve(model, mode, args.nproc, images, args.tokens, tmp, args.resident_units)
                 for mode in ("shard", "replicate")}
    shard, replicate = modes["shard"], modes["replicate"]
    summary = {
        "dtype": shard["dtype"], "family": args.family, "nproc": args.nproc, "tokens": args.tokens,
        "resident_units": args.resident_units,
        "image": "448x448 (%d tokens)" % (1024 if args.family == "llava" else 256),
        "transformers": ref, "shard": shard, "replicate": replicate,
        "request_shard_over_replicate": shard["request_new_s"] / replicate["request_new_s"],
        "request_shard_over_transformers": shard["request_new_s"] / ref["request_s"],
        "ttft_repeat_over_new": {m: v["ttft_repeat_s"] / v["ttft_new_s"] for m, v in modes.items()},
        "ttft_after_other_text_over_new": {m: v["ttft_after_other_text_s"] / v["ttft_new_s"] for m, v in modes.items()},
        "target_repeat": TARGET_REPEAT,
        "same_text": {m: v["text"] == ref["text"] for m, v in modes.items()},
    }
    for mode, v in modes.items():
        log(f"{mode} ({v['dtype']}): new image ttft {v['ttft_new_s']:.3f} s, request {v['request_new_s']:.3f} s, "
            f"repeat ttft {v['ttft_repeat_s']:.3f} s ({v['ttft_repeat_s'] / v['ttft_new_s']:.2f}x; target <= "
            f"{TARGET_REPEAT}), after other text ttft {v['ttft_after_other_text_s']:.3f} s "
            f"({v['ttft_after_other_text_s'] / v['ttft_new_s']:.2f}x: embeddings cached); bytes read {v['load_bytes_read']}, shards {v['shard_bytes']}, pss {v['pss_bytes']}")
    print(json.dumps(summary, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
