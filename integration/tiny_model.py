"""Builds a tiny random Llama and its tokenizer on disk, with no hub access.

The integration tests need a model vLLM can load on CPU in seconds; what it says does not
matter, only that greedy output is deterministic and depends on the prompt and on the KV cache.
Neighbours: `harness.py` runs vLLM on the directory this writes; `conftest.py` builds it once
per session.

Usage: python integration/tiny_model.py OUT_DIR [--seed N]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
UNK_ID, BOS_ID, EOS_ID = 256, 257, 258
WEIGHT_STD = 0.2  # large enough that greedy outputs vary from step to step and prompt to prompt
MAX_POSITIONS = 4096


def byte_to_char() -> dict[int, str]:
    """Maps each byte to the printable character that byte-level BPE uses for it (GPT-2's scheme:
    printable Latin-1 bytes map to themselves, the rest to code points from 256 upwards)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_tokenizer(out_dir: Path) -> None:
    """Writes a byte-level tokenizer with no merges: token id == byte value, then `<unk>`, `<s>`,
    `</s>`. Every UTF-8 string round-trips and a prompt of n bytes is n + 1 tokens (BOS first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in byte_to_char().items()}
    vocab.update({tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", model_max_length=MAX_POSITIONS
    )
    fast.save_pretrained(out_dir)


def build_model(out_dir: Path, seed: int) -> None:
    """Writes a 2-layer Llama (head_dim 32, one of vLLM CPU attention's supported sizes) whose
    weights are drawn from N(0, WEIGHT_STD) by a generator seeded with `seed`, in a fixed order,
    so the same seed gives the same bytes whatever transformers' own init does."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * WEIGHT_STD)
    model.save_pretrained(out_dir, safe_serialization=True)


def build(out_dir: str | Path, seed: int = 0) -> Path:
    """Builds tokenizer and model into `out_dir` (created if missing) and returns it.

    Args:
        out_dir: target directory; existing files of the same names are overwritten.
        seed: weight seed; different seeds give different models with the same tokenizer.

    Returns:
        The directory, ready for `LLM(model=...)`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    build_model(out, seed)
    (out / "tidekv_tiny_model.json").write_text(json.dumps({"seed": seed, "weight_std": WEIGHT_STD}) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    t0 = time.monotonic()
    out = build(args.out_dir, args.seed)
    print(f"tiny model (seed {args.seed}) written to {out} in {time.monotonic() - t0:.1f} s")


if __name__ == "__main__":
    main()
