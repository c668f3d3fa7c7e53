"""A long prompt's prefill on a multi-head latent attention model: chunks expanded where that costs
less (the engine's choice, ``server.engine.mla.Absorbed.expands``) against every chunk absorbed.

    python -m benchmarks.mla_prefill [--shape mla-tiny|v3] [--context 2048] [--chunk 512] [--repeats 3]
                                     [--dtype float32|bfloat16]

One CPU rank, in process: the real engine (scheduler plan, rank engine's packed forward over the
paged latent cache), one prompt of ``--context`` tokens prefilled in chunks of ``--chunk``
(``--max-batch-prefill-tokens``), timed from submission to its first token. Modes, alternating,
median of ``--repeats``:

  chosen     the engine as it ships: each chunk expanded or absorbed by its arithmetic
  absorbed   every chunk absorbed (the engine before the choice; decodes always are)

and beside them transformers' own forward of the whole prompt on the same model (it expands the
whole context in every layer), the peer. The first tokens of both modes are checked equal.

Shapes: ``mla-tiny`` is benchmarks.models.mla_checkpoint (hidden 512, 8 layers, 8 heads, latent 128
+ rope 32, heads of 64 + 32, values of 64); ``v3`` has DeepSeek-V3's attention proportions (latent
512 + rope 64, heads of 128 + 64, values of 128, 16 heads) at hidden 1024 and 4 layers, random
weights built in process. Prints one JSON document; the dtype is printed with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def _model(shape: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from benchmarks.models import mla_checkpoint

    if shape == "mla-tiny":
        return AutoModelForCausalLM.from_pretrained(mla_checkpoint(), dtype=dtype).eval()
    torch.manual_seed(0)
    config = DeepseekV3Config(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                              num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=768,
                              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=4,
                              max_position_embeddings=8192)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def _prefill(model, prompt: list[int], chunk: int) -> tuple[float, int, int]:
    """Seconds from submission to the prompt's first token, that token, and the steps it took."""
    from server.engine import BlockPool, RankEngine, RequestHandle, SamplingParams, Scheduler

    block_size = 16
    blocks = -(-(len(prompt) + 8) // block_size) + 1
    engine = RankEngine(model, torch.device("cpu"), 0, num_blocks=blocks, block_size=block_size)
    scheduler = Scheduler(pools=[BlockPool(blocks, block_size, prefix_caching=False)], replicas=[[0]],
                          max_running=1, max_total_tokens=len(prompt) + 8, eos_token_ids=set(),
                          max_prefill_tokens=chunk, idle_wait_s=0.01)
    first: list[int] = []
    t0 = time.perf_counter()
    scheduler.submit(RequestHandle(prompt, SamplingParams(max_new_tokens=1), deliver=lambda e: first.append(e.token_id)))
    steps = 0
    while not first:
        plan = scheduler.next_plan()
        scheduler.on_results([engine.step(plan)])
        steps += 1
    return time.perf_counter() - t0, first[0], steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("mla-tiny", "v3"), default="mla-tiny")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()

    import server.engine.mla as mla

    dtype = getattr(torch, args.dtype)
    model = _model(args.shape, dtype)
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, model.config.vocab_size, (args.context,), generator=gen).tolist()
    chooses = mla.Absorbed.expands
    times: dict[str, list[float]] = {"chosen": [], "absorbed": [], "transformers": []}
    tokens, steps = {}, {}
    for _ in range(args.repeats):
        for mode in ("chosen", "absorbed"):
            mla.Absorbed.expands = chooses if mode == "chosen" else (lambda self, queries, context: False)
            try:
                seconds, tokens[mode], steps[mode] = _prefill(model, prompt, args.chunk)
            finally:
                mla.Absorbed.expands = chooses
            times[mode].append(seconds)
        with torch.no_grad():  # the peer: transformers' forward of the whole prompt (its own attention)
            t0 = time.perf_counter()
            model(torch.tensor([prompt]), use_cache=False, logits_to_keep=1)
            times["transformers"].append(time.perf_counter() - t0)
    median = {mode: statistics.median(t) for mode, t in times.items()}
    text = model.config
    print(json.dumps({
        "shape": args.shape, "dtype": args.dtype, "context": args.context, "chunk": args.chunk,
        "threads": torch.get_num_threads(),
        "attention": {"heads": text.num_attention_heads, "kv_lora_rank": text.kv_lora_rank,
                      "qk_nope_head_dim": text.qk_nope_head_dim, "qk_rope_head_dim": text.qk_rope_head_dim,
                      "v_head_dim": text.v_head_dim, "layers": text.num_hidden_layers},
        "prefill_s": {mode: round(s, 4) for mode, s in median.items()},
        "all_s": {mode: [round(s, 4) for s in t] for mode, t in times.items()},
        "chosen_over_absorbed": round(median["chosen"] / median["absorbed"], 3),
        "chosen_over_transformers": round(median["chosen"] / median["transformers"], 3),
        "steps": steps, "first_tokens_equal": tokens["chosen"] == tokens["absorbed"],
    }, indent=1))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
