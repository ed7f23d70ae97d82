"""Random-weight models at real shapes, made into GGUF files by llama.cpp's own tools, for measuring specrt beside
llama.cpp at sizes and shapes nobody tuned for (docs/benchmarks.md, "Any GGUF").

    python scripts/random_gguf.py llama-360m --out ~/gguf --llama-cpp SRC [--types Q4_K_M,Q4_0,Q8_0]

writes ~/gguf/llama-360m-F16.gguf and one file per type (~/gguf/llama-360m-Q4_K_M.gguf, ...): a Hugging Face
checkpoint of the shape with random weights (normal, std 0.02; norms 1) and SmolLM2's tokenizer (read from the
preset's GGUF; a larger vocabulary padded as the converter pads it), converted by llama.cpp's
`convert_hf_to_gguf.py` and quantized by `llama_model_quantize` (Q4_K_M: llama.cpp's own mix of Q4_K, Q6_K and, for
rows not a multiple of 256, Q5_0 / Q8_0). SRC is a llama.cpp source tree with the converter beside its `gguf-py/`
and `conversion/` folders, such as llama-cpp-python's sdist's `vendor/llama.cpp`
(`pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`). Run it where llama-cpp-python, torch,
transformers, safetensors, sentencepiece and gguf are installed (not specrt's venv: llama-cpp-python compiles
llama.cpp).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

SHAPES = {  # the shapes of SmolLM2-360M, SmolLM2-1.7B and Qwen3-0.6B
    "llama-360m": dict(arch="LlamaForCausalLM", model_type="llama", hidden=960, heads=15, kv_heads=5, head_dim=64,
                       layers=32, ffn=2560, vocab=49152, rope_theta=100000.0),
    "llama-1.7b": dict(arch="LlamaForCausalLM", model_type="llama", hidden=2048, heads=32, kv_heads=32, head_dim=64,
                       layers=24, ffn=8192, vocab=49152, rope_theta=130000.0),
    "qwen3-0.6b": dict(arch="Qwen3ForCausalLM", model_type="qwen3", hidden=1024, heads=16, kv_heads=8, head_dim=128,
                       layers=28, ffn=3072, vocab=151936, rope_theta=1000000.0),
}
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
SMOLLM2_GGUF = Path(os.environ.get("SPECRT_CACHE", Path.home() / ".cache" / "specrt")) / "models" / \
    "SmolLM2-135M-Instruct.Q4_1.gguf"


def hf_checkpoint(shape: dict, out: Path, tokenizer_gguf: Path, seed: int) -> None:
    """config.json, model.safetensors (fp16, random) and SmolLM2's tokenizer files in `out`."""
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_gguf.parent), gguf_file=tokenizer_gguf.name)
    tok.save_pretrained(str(out))
    d, hd, ff = shape["hidden"], shape["head_dim"], shape["ffn"]
    config = {"architectures": [shape["arch"]], "model_type": shape["model_type"], "hidden_size": d,
              "intermediate_size": ff, "num_hidden_layers": shape["layers"], "num_attention_heads": shape["heads"],
              "num_key_value_heads": shape["kv_heads"], "head_dim": hd, "vocab_size": shape["vocab"],
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": shape["rope_theta"],
              "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "float16",
              "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    rng = np.random.default_rng(seed)
    normal = lambda *s: (rng.standard_normal(s, dtype=np.float32) * 0.02).astype(np.float16)  # noqa: E731
    ones = lambda n: np.ones(n, np.float16)  # noqa: E731
    w = {"model.embed_tokens.weight": normal(shape["vocab"], d), "model.norm.weight": ones(d)}
    q, kv = shape["heads"] * hd, shape["kv_heads"] * hd
    for i in range(shape["layers"]):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": normal(q, d), p + "self_attn.k_proj.weight": normal(kv, d),
                  p + "self_attn.v_proj.weight": normal(kv, d), p + "self_attn.o_proj.weight": normal(d, q),
                  p + "mlp.gate_proj.weight": normal(ff, d), p + "mlp.up_proj.weight": normal(ff, d),
                  p + "mlp.down_proj.weight": normal(d, ff), p + "input_layernorm.weight": ones(d),
                  p + "post_attention_layernorm.weight": ones(d)})
        if shape["model_type"] == "qwen3":
            w.update({p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd)})
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})


def quantize(src: Path, dst: Path, ftype: int, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        sys.exit(f"random_gguf: llama_model_quantize failed for {dst.name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--out", type=Path, required=True, help="folder for the GGUF files")
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree (convert_hf_to_gguf.py)")
    ap.add_argument("--types", default="Q4_K_M,Q4_0,Q8_0", help=f"comma-separated, of {', '.join(FTYPES)}")
    ap.add_argument("--tokenizer-gguf", type=Path, default=SMOLLM2_GGUF,
                    help="a GGUF whose tokenizer the model gets [default: the smollm2 preset's]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    types = [t for t in args.types.split(",") if t]
    unknown = [t for t in types if t not in FTYPES]
    if unknown:
        sys.exit(f"random_gguf: unknown type {unknown[0]} (one of {', '.join(FTYPES)})")
    converter = args.llama_cpp / "convert_hf_to_gguf.py"
    if not converter.is_file():
        sys.exit(f"random_gguf: no convert_hf_to_gguf.py in {args.llama_cpp}")
    if not args.tokenizer_gguf.is_file():
        sys.exit(f"random_gguf: no tokenizer GGUF at {args.tokenizer_gguf} (`specrt fetch-model smollm2`)")
    args.out.mkdir(parents=True, exist_ok=True)
    f16 = args.out / f"{args.shape}-F16.gguf"
    if not f16.is_file():
        with tempfile.TemporaryDirectory(dir=args.out) as tmp:
            print(f"random_gguf: {args.shape}: random checkpoint", flush=True)
            hf_checkpoint(SHAPES[args.shape], Path(tmp), args.tokenizer_gguf, args.seed)
            print(f"random_gguf: {args.shape}: convert_hf_to_gguf.py -> {f16.name}", flush=True)
            env = {**os.environ, "PYTHONPATH": str(args.llama_cpp / "gguf-py")}
            partial = f16.with_suffix(".partial")
            subprocess.run([sys.executable, str(converter), tmp, "--outfile", str(partial), "--outtype", "f16"],
                           check=True, env=env)
            partial.rename(f16)
    for t in types:
        dst = args.out / f"{args.shape}-{t}.gguf"
        if dst.is_file():
            continue
        print(f"random_gguf: {args.shape}: llama_model_quantize -> {dst.name}", flush=True)
        partial = dst.with_suffix(".partial")
        quantize(f16, partial, FTYPES[t], args.threads)
        partial.rename(dst)
    print("\n".join(str(args.out / f"{args.shape}-{t}.gguf") for t in types))


if __name__ == "__main__":
    main()
