"""A tiny Llama checkpoint made on the spot (random weights, a word-level tokenizer), so
that real sglang servers can load a model with no download.

    python -m tests.e2e.tiny_model OUTDIR     # or make_tiny_model(OUTDIR)

Shape: 2 layers, hidden 128, 4 attention heads and 2 KV heads (head_dim 32), vocab
1024, bf16: a KV page of 16 tokens is 2 layers x 2 (K, V) x 16 x 2 x 32 x 2 bytes = 8 KiB.
Greedy outputs of random weights are deterministic for a given seed, which is all the
tests need: the same prompt gives the same tokens through one server and through a PD
pair only if the right KV crossed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Words the tokenizer knows; prompts are made of them (tests.e2e.deploy.prompt).
WORDS = (
    "the a an one two three four five six seven eight nine ten red green blue "
    "cache page block layer token prefill decode transfer memory release resume "
    "server request answer model weight update pause continue abort timeout "
    "kernel tensor value key head batch queue chunk state epoch engine router "
    "client stream fast slow small large early late first last next every"
).split()

CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def make_tiny_model(out: str | Path, seed: int = 0) -> Path:
    """Write the checkpoint and tokenizer to ``out`` (created); return it.  Idempotent:
    a directory that already holds the finished checkpoint is returned as it is."""
    out = Path(out)
    done = out / "kvmem-tiny-model.json"
    if done.exists():
        return out
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    special = ["<unk>", "<s>", "</s>", "<pad>"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=CONFIG["vocab_size"], special_tokens=special)
    # every id the model can sample decodes to a word: the vocabulary is filled up to
    # vocab_size with w0, w1, ... after the words above
    filler = [f"w{i}" for i in range(CONFIG["vocab_size"] - len(special) - len(WORDS))]
    tok.train_from_iterator([" ".join(WORDS + filler)], trainer=trainer)
    assert tok.get_vocab_size() == CONFIG["vocab_size"], tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.save_pretrained(out)
    config = LlamaConfig(
        **CONFIG,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    done.write_text(json.dumps({"seed": seed, **CONFIG}) + "\n")
    return out


if __name__ == "__main__":
    print(make_tiny_model(sys.argv[1]))
