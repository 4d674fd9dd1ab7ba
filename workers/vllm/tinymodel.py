"""A tiny random-weight Llama for running a real vLLM here, with the offline tokenizer folder of
`workers.tinymodel` beside it.

No hub download is possible, so the weights come from a ``transformers.LlamaConfig`` saved with
``save_pretrained`` (random, so the text is gibberish; what matters is that the engine does real
prefill work, caches real blocks and publishes real KV events), and the tokenizer is
`workers.tinymodel.write_tokenizer_folder` (byte-level BPE trained in-process, a Llama-3-style
chat template) — the same folder the router loads with ``--model-path``.

The weights need torch and transformers, i.e. the vLLM environment::

    .venv-vllm/bin/python -m workers.vllm.tinymodel OUT_DIR [--layers 4 --hidden 512]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from workers.tinymodel import write_tokenizer_folder

HEAD_DIM = 64  # vLLM's CPU attention has kernels for some head sizes only (16 is refused)


def write_model(out_dir: Path, *, layers: int = 4, hidden: int = 512,
                max_positions: int = 4096, seed: int = 0) -> Path:
    """Random Llama weights (bfloat16 safetensors) + the tokenizer folder into ``out_dir``."""
    if hidden % HEAD_DIM:
        raise ValueError(f"hidden size must be a multiple of {HEAD_DIM}")
    try:  # only the vLLM environment has them; the router's never does
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        raise SystemExit(f"writing model weights needs torch and transformers ({exc}); run "
                         "this with the vLLM environment's python (make vllm-env)") from None
    info = write_tokenizer_folder(out_dir, max_length=max_positions)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=info.vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, num_attention_heads=hidden // HEAD_DIM,
        num_key_value_heads=hidden // HEAD_DIM, max_position_embeddings=max_positions,
        bos_token_id=info.bos_token_id, eos_token_id=info.eos_token_id,
        pad_token_id=info.pad_token_id,
        tie_word_embeddings=True, torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workers.vllm.tinymodel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    args = p.parse_args(argv)
    write_model(args.out_dir, layers=args.layers, hidden=args.hidden)
    print(f"wrote {args.out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
