"""What a step's grammar work costs: masks for M constrained rows, and a new sequence's matcher.

    python -m benchmarks.grammar_masks [--rows 1,8,32] [--batch 32] [--repeats 20]

With the default model's tokenizer (SmolLM2: a 49k vocabulary, as llguidance sees in serving):

  masks     M rows (a JSON schema each, a few tokens in) of a batch of ``batch``: per row (a mask
            filled, unpacked and applied row by row, as before) against batched
            (``GrammarRows.masks``: one fill for all rows, one unpack, one masked write)
  matcher   the call grammar of 128 tools of 50 properties: a compile, a copy of the compiled form,
            and a copy fed 64 tokens in one call (a recomputed sequence)

Prints one JSON document (medians, seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from benchmarks.grammar_step import SCHEMA


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _per_row(grammars, matchers, logits_NV, rows) -> None:
    """The row-by-row path: a bitmask per row, unpacked to [vocab] bool, masked into its row."""
    import llguidance.torch

    vocab = logits_NV.shape[1]
    bits = torch.arange(32, dtype=torch.int32)
    for i, matcher in zip(rows, matchers):
        bitmask = llguidance.torch.allocate_token_bitmask(1, grammars.vocab_size)
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        allowed = ((bitmask[0][:, None] >> bits) & 1).bool().flatten()[:vocab]
        logits_NV[i].masked_fill_(~allowed, float("-inf"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from transformers import AutoTokenizer

    from loaders.sources.default_model import ensure_default_checkpoint
    from server.api.openai.tools import FORMATS
    from server.engine.grammar import GrammarRows, Grammars, grammar_for

    tokenizer = AutoTokenizer.from_pretrained(ensure_default_checkpoint())
    grammars = Grammars(tokenizer)
    grammar = grammar_for("json_schema", SCHEMA)
    prefix = tokenizer('{"title":"fruits","items":["apple","pe', add_special_tokens=False).input_ids
    doc: dict = {"benchmark": "grammar_masks", "vocab": grammars.vocab_size, "batch": args.batch, "masks": []}
    for m in (int(r) for r in args.rows.split(",")):
        rows = list(range(0, args.batch, max(1, args.batch // m)))[:m]
        engine_rows = GrammarRows(grammars)
        matchers = []
        for n, _ in enumerate(rows):
            generated = prefix[:n % len(prefix)]
            engine_rows.start(n, grammar, generated)
            matcher = grammars.matcher(grammar)
            matcher.consume_tokens(generated)
            matchers.append(matcher)
        logits_NV = torch.randn(args.batch, grammars.vocab_size)
        entries = [(row, n, grammar, prefix[:n % len(prefix)]) for n, row in enumerate(rows)]

        def batched() -> None:
            masks, _ = engine_rows.masks(entries, logits_NV.shape[1], logits_NV.device)
            masked = torch.where(masks.allowed_MV, logits_NV.index_select(0, masks.rows_M), float("-inf"))
            logits_NV.index_copy_(0, masks.rows_M, masked)

        per_row_s = _median_s(lambda: _per_row(grammars, matchers, logits_NV, rows), args.repeats)
        batched_s = _median_s(batched, args.repeats)
        doc["masks"].append({"rows": m, "per_row_s": per_row_s, "batched_s": batched_s})
        print(f"[grammar_masks] {m} rows: per row {per_row_s * 1e3:.2f} ms, batched {batched_s * 1e3:.2f} ms",
              file=sys.stderr, flush=True)
    functions = [{"name": f"tool_{i}", "parameters": {"type": "object", "properties": {
        f"p{j}": {"type": ("string", "integer", "boolean")[j % 3]} for j in range(50)}}} for i in range(128)]
    calls = FORMATS["hermes"].grammar(functions, several=True)
    cold = Grammars(tokenizer)
    t0 = time.perf_counter()
    cold.check(calls)
    compile_s = time.perf_counter() - t0
    copy_s = _median_s(lambda: cold.matcher(calls), args.repeats)
    fed = tokenizer('<tool_call>\n{"name":"tool_7","arguments":{"p0":"a long enough string","p1":12,"p2":true,'
                    '"p3":"b","p4":3', add_special_tokens=False).input_ids

    def rebuild() -> None:
        matcher = cold.matcher(calls)
        assert matcher.consume_tokens(fed), matcher.get_error()

    doc["matcher"] = {"grammar_chars": len(calls), "compile_s": compile_s, "copy_s": copy_s,
                      "copy_and_feed_s": _median_s(rebuild, args.repeats), "fed_tokens": len(fed)}
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
