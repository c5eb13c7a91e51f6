"""Peak memory of loading each tensor-parallel rank's slice of a checkpoint.

    python -m saguaro_ray.jobs.tp_memory --model zoo:small/target --tp 1 2 [--device cuda] [--dtype bf16]
    python -m saguaro_ray.jobs.tp_memory --predict path/to/config.json --tp 4 --dtype bf16

Every rank loads in a fresh process (loading needs no process group), so
each process's peak resident set is its own: ``host_peak_mib`` is the peak
RSS during loading above the process's RSS after imports, split into
anonymous memory (tensors; what must fit) and file-backed pages of the
memory-mapped safetensors (page cache, shared and reclaimable), both as
held after loading, above the same baseline.
``device_peak_mib`` is ``torch.cuda.max_memory_allocated`` on CUDA. Prints
one JSON object per (T, rank).

``--predict`` needs only a ``config.json``: it sizes rank 0's sharded decoder
on the meta device (no weights) and prints the bytes a rank must hold —
weights, KV cache per token, and the largest single tensor slice, which is
the most a rank stages in host memory at once while loading onto a GPU.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
from typing import Any


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def measure_rank(model: str, rank: int, world: int, device: str, dtype: str | None) -> dict[str, Any]:
    """Load rank ``rank`` of ``world`` in this process and report its memory."""
    import torch

    from saguaro_ray.models.resolve import resolve_model_path
    from saguaro_ray.workers.checkpoint import load_decoder, open_checkpoint
    from saguaro_ray.workers.model_config import parse_dtype
    from saguaro_ray.workers.tensor_parallel import ShardPlan, TPContext

    ckpt = open_checkpoint(resolve_model_path(model))
    dev = torch.device(device)
    torch_dtype = parse_dtype(dtype, default=torch.float32 if dev.type == "cpu" else torch.bfloat16)
    if dev.type == "cuda":
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats()
    base = {f: _status_kib(f) for f in ("VmRSS", "RssAnon", "RssFile")}
    tp = None if world == 1 else TPContext(ShardPlan.for_rank(ckpt.config, rank, world))
    model_ = load_decoder(ckpt, dev, torch_dtype, tp)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    params = sum(p.numel() * p.element_size() for p in model_.parameters())
    return {
        "model": str(ckpt.path),
        "tp": world,
        "rank": rank,
        "dtype": str(torch_dtype).removeprefix("torch."),
        "param_mib": round(params / 2**20, 2),
        "host_peak_mib": round((peak_kib - base["VmRSS"]) / 1024, 2),
        "host_anon_mib": round((_status_kib("RssAnon") - base["RssAnon"]) / 1024, 2),
        "host_file_mib": round((_status_kib("RssFile") - base["RssFile"]) / 1024, 2),
        "device_peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 2) if dev.type == "cuda" else None,
    }


def predict(config_json: str, world: int, dtype: str | None) -> dict[str, Any]:
    """Rank 0's memory for ``world`` ranks, from a config alone (every rank is
    the same size up to the last vocabulary shard)."""
    import torch

    from saguaro_ray.workers.decoder import Decoder
    from saguaro_ray.workers.model_config import DecoderConfig, parse_dtype
    from saguaro_ray.workers.tensor_parallel import ShardedDecoder, ShardPlan, TPContext

    with open(config_json) as f:
        cfg = DecoderConfig.from_hf(json.load(f), source=config_json)
    plan = ShardPlan.for_rank(cfg, 0, world)
    meta = torch.device("meta")
    with meta:
        model = Decoder(cfg, meta) if world == 1 else ShardedDecoder(cfg, TPContext(plan), meta)
    size = parse_dtype(dtype, default=torch.bfloat16).itemsize
    gib = 2**30
    return {
        "config": config_json,
        "tp": world,
        "params_per_rank": sum(p.numel() for p in model.parameters()),
        "weights_gib_per_rank": round(sum(p.numel() for p in model.parameters()) * size / gib, 3),
        "kv_kib_per_token_per_rank": 2 * cfg.num_layers * plan.num_kv_heads * cfg.head_dim * size / 1024,
        "largest_slice_mib": round(max(p.numel() for p in model.parameters()) * size / 2**20, 1),
    }


def _worker(args: tuple[str, int, int, str, str | None]) -> dict[str, Any]:
    return measure_rank(*args)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="zoo:small/target")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--predict", default=None, metavar="CONFIG_JSON", help="size the ranks from a config.json, load nothing")
    args = p.parse_args(argv)
    if args.predict:
        for world in args.tp:
            print(json.dumps(predict(args.predict, world, args.dtype)), flush=True)
        return
    ctx = mp.get_context("spawn")
    for world in args.tp:
        for rank in range(world):
            with ctx.Pool(1) as pool:  # a fresh process per rank: its own peak RSS
                print(json.dumps(pool.apply(_worker, ((args.model, rank, world, args.device, args.dtype),))), flush=True)


if __name__ == "__main__":
    main()
