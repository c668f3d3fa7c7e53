"""Per-token cost of turning tokens into text, at 100 and 4000 tokens of output.

    python -m benchmarks.detokenize [--lengths 100,4000] [--model DIR]

What one request's API side does per generated token (server.api.generation.RequestStream and the
OpenAI stream): the incremental detokenizer, the stop-sequence check, the OpenAI held-back
deltas (server.api.outputs), against what the engine did before (decode all generated ids again for every token, and
diff the whole text). The tokenizer is the default model's (SmolLM2), or ``--model``'s. Prints
one JSON document: microseconds per token at each length, for both, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

TEXT = ("The capital of France is Paris. Ünïcödé, 日本語 and emoji 🙂 mix with plain ASCII words, numbers "
        "like 3.14159, and code: def f(x): return x * 2. ")


def _incremental(tokenizer, ids: list[int]) -> float:
    from server.api.outputs import OutputProcessor
    from server.engine.scheduler import TokenEvent

    output = OutputProcessor(tokenizer, ["</answer>", "\n\n\n"])
    start = time.perf_counter()
    for token in ids:
        output.process(TokenEvent(token, 0.0))  # the text it adds, the stop sequences, what may be shown
        output.token_text(token)  # its own text, as logprobs and TGI's details show it
    return time.perf_counter() - start


def _rebuild(tokenizer, ids: list[int]) -> float:
    """The old path: the whole generated text decoded again per token, and diffed."""
    sent = 0
    start = time.perf_counter()
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n], skip_special_tokens=True)
        tokenizer.decode([ids[n - 1]])
        sent = len(text) if len(text) > sent else sent
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.detokenize", description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="100,4000")
    parser.add_argument("--model", help="a checkpoint directory whose tokenizer to use (default: the default model)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from loaders.sources import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(args.model or resolve_model(None).path)
    report = {"tokenizer": type(tokenizer).__name__, "lengths": {}}
    for length in (int(n) for n in args.lengths.split(",")):
        ids = (tokenizer(TEXT * (length // 20 + 1), add_special_tokens=False).input_ids)[:length]
        new = min(_incremental(tokenizer, ids) for _ in range(args.repeats)) / length * 1e6
        old = min(_rebuild(tokenizer, ids) for _ in range(max(1, args.repeats if length <= 1000 else 1))) / length * 1e6
        report["lengths"][length] = {"incremental_us_per_token": round(new, 2), "rebuild_us_per_token": round(old, 2),
                                     "ratio_rebuild_to_incremental": round(old / new, 1)}
        print(f"[detokenize] {length} tokens: {new:.1f} us/token incremental, {old:.1f} us/token rebuilt",
              file=sys.stderr, flush=True)
    lengths = sorted(report["lengths"])
    if len(lengths) >= 2:
        first, last = report["lengths"][lengths[0]], report["lengths"][lengths[-1]]
        report["incremental_growth"] = round(last["incremental_us_per_token"] / first["incremental_us_per_token"], 2)
        report["rebuild_growth"] = round(last["rebuild_us_per_token"] / first["rebuild_us_per_token"], 2)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
