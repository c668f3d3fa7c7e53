"""The random-weight demo checkpoint: a small Llama and a locally trained tokenizer.

Nothing is downloaded. The weights are random, so the demo's text is random too: it exercises
the whole serving path, not a language model. It is served only where the real default
(:mod:`loaders.sources.default_model`) cannot be fetched; tests use its pieces to build
checkpoints of the architectures they need.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

import torch

logger = logging.getLogger(__name__)

_CORPUS = """
hsdp-serve shards the weights of a causal language model over a group of ranks with FSDP2 on a
two-dimensional device mesh, replicate by shard. Every rank reads the checkpoint directly and
keeps only its rows of each tensor. Rank zero answers HTTP requests; every rank runs every
forward in lockstep, because the all-gathers of the sharded parameters are collectives.
The quick brown fox jumps over the lazy dog. 0123456789 +-*/=()[]{}<>.,;:!?'"
Once upon a time there was a server that never hung and never lost a request silently.
"""
DEMO_VERSION = 1
DEMO_NAME = f"demo-llama-v{DEMO_VERSION}"


def train_byte_bpe_tokenizer(vocab_size: int = 384, corpus: str = _CORPUS, *, all_bytes: bool = True):
    """A byte-level BPE tokenizer trained on ``corpus``, as a transformers fast tokenizer.

    Its special tokens: ``<|endoftext|>`` (bos/eos/pad) and ``<unk>``. With ``all_bytes`` False
    the vocabulary holds only the bytes ``corpus`` uses (ASCII for the default corpus), so that
    every token decodes to whole characters: a random-weight model then streams text on every
    token instead of partial UTF-8 sequences held back until they complete.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if all_bytes else [],
        show_progress=False,
    )
    tok.train_from_iterator([line for line in corpus.splitlines() if line] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
    )


def demo_llama_config(vocab_size: int, **overrides):
    from transformers import LlamaConfig

    params = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    params.update(overrides)
    return LlamaConfig(**params)


def create_demo_checkpoint(path: str, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> str:
    """Write the demo checkpoint to ``path`` (atomically: a half-written one is never seen)."""
    from transformers import LlamaForCausalLM

    tokenizer = train_byte_bpe_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(demo_llama_config(len(tokenizer))).to(dtype)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".demo-", dir=parent)
    model.save_pretrained(tmp, max_shard_size="2MB")
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, "hsdp_demo.json"), "w") as f:
        json.dump({"version": DEMO_VERSION, "note": "random weights: the generated text is random"}, f)
    try:
        os.rename(tmp, path)
    except OSError:
        # Another process created it first; keep theirs.
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path


def ensure_demo_checkpoint(cache_dir: str | None = None) -> str:
    """The demo checkpoint's directory, created once under the user's cache directory."""
    from loaders.sources.default_model import cache_root

    path = os.path.join(cache_root(cache_dir), DEMO_NAME)
    if not os.path.isfile(os.path.join(path, "hsdp_demo.json")):
        logger.info("creating the demo checkpoint (random weights) in %s", path)
        create_demo_checkpoint(path)
    return path
