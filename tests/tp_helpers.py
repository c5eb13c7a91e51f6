"""Tensor-parallel test helpers that spawned rank processes import.

Kept apart from the test module so a spawned rank imports torch and the
runner only (not pytest fixtures or Ray). :func:`scenario` is the one call
sequence every configuration runs — the unsharded reference in the test
process and rank 0 of a sharded group — so both see identical inputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from saguaro_ray.runtime.data_plane import StoreClient
from saguaro_ray.workers.checkpoint import open_checkpoint
from saguaro_ray.workers.runner import ModelRunner
from saguaro_ray.workers.tensor_parallel import ShardPlan, TPContext
from saguaro_ray.workers.tp_runner import TPRunnerProxy, follow


RUNNER_KWARGS: dict[str, Any] = {"block_size": 4, "max_kv_tokens": 128}


def scenario(runner: Any) -> list[torch.Tensor]:
    """Prefill, a multi-token verify, rollback + refeed, and a tree decode; every logit row."""
    r, out = runner, []
    r.add_sequence(0)
    r.add_sequence(1)
    out.append(r.forward([0, 1], [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22]], all_logits=True))  # prefill
    out.append(r.forward([0, 1], [[12, 13, 14, 15], [23, 24, 25, 26]], all_logits=True))  # verify K+1 = 4
    r.truncate(0, 9)  # rejection: roll back and refeed different tokens
    r.truncate(1, 4)
    out.append(r.forward([0, 1], [[30, 31, 32], [33, 34]], num_logits=[2, 1]))
    tree = r.tree_start([0, 0, 1], [12, 10, 6], depth=4)
    out.append(r.tree_forward(tree, [[40], [41], [42]]))
    out.append(r.tree_forward(tree, [[43, 44], [45, 46], [47, 48]]))
    r.free_sequence(0)
    out.append(r.forward([1], [[50, 51]], all_logits=True))
    return [t.float().cpu() for t in out]


def rank_main(rank: int, world: int, address: str, key: bytes, models: list[str], out_dir: str) -> None:
    """One rank of a gloo group running :func:`scenario` on every model in turn
    (one group serves them all); rank 0 saves each model's logits. The ranks
    meet through the authenticated store at ``address``, as the runtime's do.

    The first model's context owns the group; the others borrow it for their
    model and hand it back, so :meth:`TPContext.close` frees the group (and
    joins gloo's threads) before the process exits."""
    torch.set_num_threads(1)
    group: TPContext | None = None
    store = StoreClient(address, key, timeout_s=60.0)
    for i, path in enumerate(models):
        ckpt = open_checkpoint(path)
        tp = TPContext(ShardPlan.for_rank(ckpt.config, rank, world), exit_on_failure=False)
        runner = ModelRunner(ckpt, tp=tp, **RUNNER_KWARGS)
        if group is None:
            tp.connect(store, runner.device)
            group = tp
        else:
            tp.group, tp.control = group.group, group.control
        try:
            if rank == 0:
                proxy = TPRunnerProxy(runner, tp)
                torch.save(scenario(proxy), Path(out_dir) / f"{i}.pt")
                proxy.stop()
            else:
                follow(runner, tp)
        finally:
            if tp is not group:
                tp.group = tp.control = None
    assert group is not None
    group.close()
    store.close()
