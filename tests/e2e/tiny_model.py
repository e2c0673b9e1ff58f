"""Tiny checkpoints made on the spot (random weights, a word-level tokenizer), so that
real sglang servers can load a model of each attention family with no download.

    python -m tests.e2e.tiny_model OUTDIR [FAMILY]   # or make_tiny_model(OUTDIR, family=...)

Families (:data:`FAMILIES`), each 2 layers, hidden 128, vocabulary 1024, bf16:

* ``llama``: a Llama, 4 attention heads and 2 KV heads (head_dim 32).  sglang builds an
  ``MHATokenToKVPool``; a KV page of 16 tokens is 2 layers x 2 (K, V) x 16 x 2 x 32 x 2
  bytes = 8 KiB.
* ``mla``: a DeepSeek-V3 (multi-head latent attention): ``kv_lora_rank`` 64,
  ``qk_rope_head_dim`` 16, ``qk_nope_head_dim`` 32, ``v_head_dim`` 32, no query LoRA, both
  layers dense (``first_k_dense_replace`` 2: no MoE layer).  sglang builds an
  ``MLATokenToKVPool`` of one latent row per token and layer, 64 + 16 = 80 values: a page
  of 16 tokens is 2 x 16 x 80 x 2 bytes = 5 KiB.  What sglang's DeepSeek code reads from
  ``config.json`` besides transformers' fields is written there too (:data:`MLA_EXTRA`).
* ``swa``: a Mellum (hybrid sliding-window attention): layer 0 attends to a window of 8
  tokens, layer 1 to everything, both MLPs dense, the Llama's attention sizes.  sglang
  builds an ``SWAKVPool`` of two ``MHATokenToKVPool`` (one layer each) and an
  ``SWATokenToKVPoolAllocator`` over them.

Greedy outputs of random weights are deterministic for a given seed and family, which is
all the tests need: the same prompt gives the same tokens through one server and through
a PD pair only if the right KV crossed.
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

# DeepSeek-V3 with multi-head latent attention, the sizes above where they apply.
MLA_CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=1024,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    kv_lora_rank=64,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    q_lora_rank=None,
    first_k_dense_replace=2,
    # sglang's CPU rotary embedding is DeepSeek's YaRN only (it asserts the type,
    # srt/layers/rotary_embedding/factory.py:478-481; srt/models/deepseek_v2.py:2066
    # renames "yarn" to "deepseek_yarn"); factor 1 is no scaling
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=1.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    num_nextn_predict_layers=0,
)
# Fields sglang's DeepSeek model reads that transformers' DeepseekV3Config does not
# define (srt/models/deepseek_v2.py); with first_k_dense_replace 2 no layer is MoE, but
# the model's construction reads them all the same.
MLA_EXTRA = dict(moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid")

# A hybrid sliding-window model (JetBrains' Mellum architecture): one sliding-window
# layer (window 8 tokens, so a decode of a dozen tokens crosses it) and one full layer,
# both MLPs dense, the Llama's attention sizes.
SWA_CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=1024,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"],
    mlp_layer_types=["dense", "dense"],
)

FAMILIES = ("llama", "mla", "swa")


def _tokenizer(out: Path, vocab_size: int):
    """The word-level tokenizer every family shares, saved to ``out``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>", "<pad>"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=special)
    # every id the model can sample decodes to a word: the vocabulary is filled up to
    # vocab_size with w0, w1, ... after the words above
    filler = [f"w{i}" for i in range(vocab_size - len(special) - len(WORDS))]
    tok.train_from_iterator([" ".join(WORDS + filler)], trainer=trainer)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.save_pretrained(out)
    return fast


def _model(family: str, ids: dict):
    """The family's transformers model with random weights (the caller seeded torch), and
    what describes it."""
    import torch

    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(**CONFIG, **ids, torch_dtype="bfloat16")
        return LlamaForCausalLM(config).to(torch.bfloat16), CONFIG
    if family == "mla":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        config = DeepseekV3Config(**MLA_CONFIG, **ids, torch_dtype="bfloat16")
        for k, v in MLA_EXTRA.items():
            setattr(config, k, v)
        return DeepseekV3ForCausalLM(config).to(torch.bfloat16), {**MLA_CONFIG, **MLA_EXTRA}
    if family == "swa":
        from transformers import MellumConfig, MellumForCausalLM

        config = MellumConfig(**SWA_CONFIG, **ids, torch_dtype="bfloat16")
        return MellumForCausalLM(config).to(torch.bfloat16), SWA_CONFIG
    raise ValueError(f"unknown model family {family!r}; one of {FAMILIES}")


def make_tiny_model(out: str | Path, seed: int = 0, family: str = "llama") -> Path:
    """Write the ``family`` checkpoint and tokenizer to ``out`` (created); return it.
    Idempotent: a directory that already holds that finished checkpoint is returned as
    it is."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; one of {FAMILIES}")
    out = Path(out)
    done = out / "kvmem-tiny-model.json"
    if done.exists():
        made = json.loads(done.read_text())
        if made.get("family", "llama") == family and made.get("seed") == seed:
            return out
        raise ValueError(f"{out} holds another tiny model ({made}), not {family!r} seed {seed}")
    import torch

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    fast = _tokenizer(out, CONFIG["vocab_size"])
    ids = dict(
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    )
    model, described = _model(family, ids)
    model.save_pretrained(out)
    done.write_text(json.dumps({"family": family, "seed": seed, **described}) + "\n")
    return out


if __name__ == "__main__":
    print(make_tiny_model(sys.argv[1], family=sys.argv[2] if len(sys.argv) > 2 else "llama"))
