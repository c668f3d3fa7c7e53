"""What one constrained row costs the other rows of a decode step.

    python -m benchmarks.grammar_step [--rows 32] [--steps 48] [--repeats 4] [--dtype auto]

The default model (SmolLM2-135M-Instruct: a real 49k vocabulary and tokenizer, as llguidance sees
in serving), unsharded in this process, driven by the real engine (scheduler plan, rank engine's
packed forward over the paged KV cache, batched sampling with the grammar's mask). Two batches of
``rows`` decoding sequences are timed step by step, in interleaved rounds:

  free         every row free text
  constrained  one row under a JSON schema (an object with an array of strings, so it can go on;
               a row that completes its grammar is replaced at once), the others free

Only decode steps are timed (a replacement's prefill step is not). Reports the median step of each
(best of the rounds' medians) and their ratio, with the dtype. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from benchmarks.models import compute_dtype

SCHEMA = {"type": "object", "properties": {"title": {"type": "string"},
                                           "items": {"type": "array", "items": {"type": "string"}}},
          "required": ["title", "items"], "additionalProperties": False}


def log(msg: str) -> None:
    print(f"[grammar_step] {msg}", file=sys.stderr, flush=True)


def time_steps(model, tokenizer, rows: int, steps: int, constrained: bool, grammar: str) -> list[float]:
    from server.engine import BlockPool, RankEngine, RequestHandle, SamplingParams, Scheduler

    block_size, context = 16, 64
    blocks = (rows + 2) * (-(-(context + 4 * steps) // block_size) + 1)
    engine = RankEngine(model, torch.device("cpu"), 0, num_blocks=blocks, block_size=block_size, tokenizer=tokenizer)
    scheduler = Scheduler(pools=[BlockPool(blocks, block_size, prefix_caching=False)], replicas=[[0]],
                          max_running=rows, max_total_tokens=context + 4 * steps, eos_token_ids=set(),
                          max_prefill_tokens=rows * context + 256, idle_wait_s=0.01)
    gen = torch.Generator().manual_seed(7)
    free_rows = rows - 1 if constrained else rows
    for _ in range(free_rows):
        prompt = torch.randint(3, len(tokenizer), (context,), generator=gen).tolist()
        scheduler.submit(RequestHandle(prompt, SamplingParams(max_new_tokens=4 * steps), deliver=lambda e: None))
    question = tokenizer.apply_chat_template(
        [{"role": "user", "content": "List ten fruits as JSON with a title and items."}],
        add_generation_prompt=True, tokenize=False)
    question_ids = tokenizer(question, add_special_tokens=False).input_ids
    replaced = [0]

    def submit_constrained() -> None:
        def deliver(event) -> None:
            if getattr(event, "finish", None) is not None or hasattr(event, "message"):
                replaced[0] += 1
                submit_constrained()

        scheduler.submit(RequestHandle(question_ids, SamplingParams(max_new_tokens=4 * steps, grammar=grammar),
                                       deliver=deliver))

    if constrained:
        submit_constrained()
    times = []
    warm = 3
    while len(times) < steps:
        plan = scheduler.next_plan()
        decode_only = all(w.count == 1 for work in plan.work.values() for w in work)
        t0 = time.perf_counter()
        result = engine.step(plan)
        scheduler.on_results([result])
        elapsed = time.perf_counter() - t0
        if decode_only and len(result.tokens) == rows:
            if warm:
                warm -= 1
            else:
                times.append(elapsed)
    log(f"{'constrained' if constrained else 'free'}: median {statistics.median(times) * 1e3:.1f} ms "
        f"({replaced[0]} constrained rows completed and replaced)")
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a serving rank's default: 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loaders.sources.default_model import ensure_default_checkpoint
    from server.engine.grammar import grammar_for, grammars_of

    path = ensure_default_checkpoint()
    dtype = compute_dtype(args.dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    grammar = grammar_for("json_schema", SCHEMA)
    grammars_of(tokenizer).check(grammar)  # llguidance's view of the vocabulary, built once (as in serving)
    medians = {"free": [], "constrained": []}
    for r in range(args.repeats):
        for mode in ("free", "constrained") if r % 2 == 0 else ("constrained", "free"):
            medians[mode].append(statistics.median(
                time_steps(model, tokenizer, args.rows, args.steps, mode == "constrained", grammar)))
    free, constrained = min(medians["free"]), min(medians["constrained"])
    doc = {
        "benchmark": "grammar_step", "model": "SmolLM2-135M-Instruct", "dtype": dtype, "threads": args.threads,
        "rows": args.rows, "steps": args.steps, "repeats": args.repeats, "schema": SCHEMA,
        "free_step_s": free, "constrained_step_s": constrained, "ratio": constrained / free,
        "rounds": medians,
    }
    print(json.dumps(doc, indent=2))
    log(f"{dtype}, {args.rows} rows: free {free * 1e3:.1f} ms, one constrained {constrained * 1e3:.1f} ms: "
        f"{constrained / free:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
