"""Memory of loading a checkpoint for ``geosharp measure --fsdp``: every process reading
the whole checkpoint and sharding it (what the command did before), against process 0
reading it and each process receiving its shards (what it does now).

    python benchmarks/fsdp_load.py [--nproc 2] [--json out.json]

A LLaMA of 16 layers, hidden 1024, vocabulary 1024 (182M parameters; embeddings 1% of
them, as in LLaMA-2-7B's 3%) is saved in bfloat16 to a temporary directory and loaded
in float32 and in bfloat16, each way in a fresh ``torchrun`` launch (gloo, one thread
per process, glibc mapping every block above 128 KiB so that the resident size is what
is held). Each process reports the rise of its peak resident size over its resident
size before loading, through the load, the pairs' discovery and verification and the
sharding (the command's pre-flight pass is not included), in MB and in whole models
(the checkpoint's size in the loaded dtype).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench_targets import _rss_status  # the peak and resident sizes, as bench_fsdp reads them
from launching import MMAP_THRESHOLD, run_json

TEXTS = ["the film was good", "a dull plot", "fun", "the plot was fun and the actor superb"]


def make(path: Path) -> None:
    import torch
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import GPT2TokenizerFast, LlamaConfig, LlamaForCausalLM

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=256,
        bos_token_id=256, eos_token_id=256, pad_token_id=None,
    )  # fmt: skip
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    tokenizer = GPT2TokenizerFast(vocab=vocab, merges=[])
    tokenizer.eos_token = "<|endoftext|>"
    tokenizer.save_pretrained(path)


def child(path: str, how: str, dtype_name: str) -> None:
    import torch
    import torch.distributed as dist

    from geosharp import distributed as gd
    from geosharp.loading.hf import load_causal_lm, load_tokenizer
    from geosharp.loading.hfdata import causal_lm_loss
    from geosharp.loading.job import _load_sharded
    from geosharp.measures.fsdp import shard
    from geosharp.symmetry import find_symmetries

    torch.set_num_threads(1)
    rank, world = gd.init()
    dtype = getattr(torch, dtype_name)
    tokenizer = load_tokenizer(path)
    tokenizer.pad_token = tokenizer.eos_token
    batch = dict(tokenizer(TEXTS, padding=True, return_tensors="pt"))
    before = _rss_status()["VmRSS"]
    if how == "every process reads":
        model = load_causal_lm(path, dtype=dtype).model
        symmetries = find_symmetries(model, batch, loss_fn=causal_lm_loss, warn=False)
        shard(model, symmetries)
    else:
        model, _, _, symmetries = _load_sharded(
            load_causal_lm, path, dtype, 0, torch.device("cpu"), batch, causal_lm_loss, False
        )
    record = {
        "rank": rank,
        "rise": _rss_status()["VmHWM"] - before,
        "held": _rss_status()["VmRSS"] - before,
        "whole": sum(p.numel() for p in model.parameters()) * dtype.itemsize,  # global
        "pairs": len(symmetries.pairs),
    }
    parts = [None] * world
    dist.all_gather_object(parts, record)
    if rank == 0:
        print(json.dumps(parts), flush=True)
    model = None
    gd.close()


def launch(path: Path, how: str, dtype: str, nproc: int) -> list[dict]:
    cmd = [__file__, "--child", how, "--path", str(path), "--dtype", dtype]
    env = {"HF_HUB_OFFLINE": "1", **MMAP_THRESHOLD}
    return run_json(cmd, nproc, 29720, env, marker="[{")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--path", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.path, args.child, args.dtype)
        return
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama"
        make(path)
        print(f"LLaMA 16 x 1024, vocabulary 1024, {args.nproc} processes; peak rise per process")
        for dtype in ("float32", "bfloat16"):
            for how in ("every process reads", "process 0 reads"):
                parts = launch(path, how, dtype, args.nproc)
                whole = parts[0]["whole"]
                rises = ", ".join(
                    f"{p['rise'] / 1e6:.0f} MB ({p['rise'] / whole:.2f} models)" for p in parts
                )
                print(f"{dtype:9s} {how:21s} whole model {whole / 1e6:.0f} MB; by process: {rises}")
                out.append({"dtype": dtype, "how": how, "processes": parts})
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
