"""A tiny random-weight Llama plus a byte-level BPE tokenizer, built offline.

vLLM needs a model directory; no hub is reachable from CI or from the test
machines, so tests, benchmarks and examples build one on the spot (needs torch,
transformers and tokenizers, which vLLM brings):

    python -m kvstore.testing.tinymodel /tmp/tiny-llama Everything here is deterministic for
a given seed: the same arguments write the same weights and the same tokenizer,
so a test can build the model twice (or in two processes) and expect the same
KV bytes.

Random weights at the default ``initializer_range`` (0.02) give near-uniform
logits: greedy decoding then repeats one token whatever the prompt, and every
logprob is about ``-log(vocab)``. A larger range (0.2 by default here) makes
outputs depend on the prompt, which is what a test that compares "loaded KV"
against "recomputed KV" needs to see a difference when the KV is wrong.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["DEFAULT_INITIALIZER_RANGE", "DEFAULT_VOCAB", "make_tiny_llama"]

# Heavy imports (torch, transformers, tokenizers) happen inside the functions:
# importing this module must stay cheap for test collection.

DEFAULT_VOCAB = 1024
DEFAULT_INITIALIZER_RANGE = 0.2

_SPECIAL_TOKENS = ["<s>", "</s>", "<unk>"]


def _corpus(seed: int, n_lines: int = 2000) -> list[str]:
    """A deterministic synthetic corpus: pseudo-words over a small alphabet."""
    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghklmnprstvz" for b in "aeiou"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(600)]
    lines = []
    for _ in range(n_lines):
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(5, 20))))
    return lines


def _train_tokenizer(dir: Path, vocab: int, seed: int) -> int:
    """Train a byte-level BPE, save it as a PreTrainedTokenizerFast; return its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=1,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=1 << 20,
    )
    fast.save_pretrained(str(dir))
    return len(fast)


def make_tiny_llama(
    dir: str | Path,
    *,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = DEFAULT_VOCAB,
    seed: int = 0,
    initializer_range: float = DEFAULT_INITIALIZER_RANGE,
    intermediate: int | None = None,
    max_position_embeddings: int = 4096,
    dtype: str = "float32",
) -> Path:
    """Write a random Llama (safetensors) and a trained tokenizer into ``dir``.

    ``vocab`` is the model's vocabulary size; the tokenizer is trained to at
    most that many entries (BPE may stop earlier on a small corpus), so every
    tokenizer id is a valid model id. Token-id prompts may use ``range(vocab)``.
    ``dtype`` is what ``config.json`` records (vLLM's ``dtype="auto"`` follows it).
    Returns ``dir`` as a Path.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden={hidden}, heads={heads}, kv_heads={kv_heads} do not divide")
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)

    n_tok = _train_tokenizer(out, vocab, seed)
    if n_tok > vocab:  # cannot happen with BpeTrainer(vocab_size=vocab); keep ids valid anyway
        raise ValueError(f"tokenizer has {n_tok} entries, more than vocab={vocab}")

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    # Seed both the CPU generator and Python's: LlamaForCausalLM's init draws
    # from torch's global generator only, in module order (deterministic).
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.save_pretrained(str(out), safe_serialization=True)
    # No generation_config defaults (vLLM would otherwise pick up sampling
    # settings from it); greedy comes from the caller's SamplingParams.
    gen = out / "generation_config.json"
    if gen.exists():
        gen.write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    return out


if __name__ == "__main__":
    import sys

    print(make_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny-llama"))
