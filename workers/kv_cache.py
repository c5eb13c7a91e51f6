"""The paged KV cache: a pool of fixed-size blocks and per-sequence block tables.

Every layer has one K and one V tensor of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; a sequence owns an
ordered list of block ids, and its token at cache index i lives in block
``table[i // block_size]`` at offset ``i % block_size``. Appending allocates
blocks lazily, truncation (rollback after a rejected speculation) frees the
blocks past the new length, so rejected tokens cost no copies at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from saguaro_ray.errors import OutOfKVBlocksError


@dataclass
class SequenceKV:
    blocks: list[int] = field(default_factory=list)
    length: int = 0


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
        # pop() hands out low block ids first; purely cosmetic, but readable in dumps
        self._free = list(range(num_blocks - 1, -1, -1))
        self.seqs: dict[object, SequenceKV] = {}

    def reserve_block(self) -> int:
        """Take one block out of the pool for good (a static step's padding
        rows write there) and return its id."""
        if not self._free:
            raise OutOfKVBlocksError("no KV block left to reserve")
        return self._free.pop()

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq_id: object, new_tokens: int) -> int:
        seq = self.seqs.get(seq_id, SequenceKV())
        want = -(-(seq.length + new_tokens) // self.block_size)
        return max(0, want - len(seq.blocks))

    def add(self, seq_id: object) -> None:
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already has a KV cache")
        self.seqs[seq_id] = SequenceKV()

    def free(self, seq_id: object) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self._free.extend(reversed(seq.blocks))

    def length(self, seq_id: object) -> int:
        return self.seqs[seq_id].length

    def reserve(self, seq_id: object, new_tokens: int) -> list[int]:
        """Grow ``seq_id`` by ``new_tokens`` cache slots; returns their flat slot indices."""
        seq = self.seqs[seq_id]
        need = self.blocks_needed(seq_id, new_tokens)
        if need > len(self._free):
            raise OutOfKVBlocksError(
                f"KV cache full: sequence {seq_id!r} needs {need} more blocks, {len(self._free)} free "
                f"of {self.num_blocks}; raise the KV capacity or lower the batch size"
            )
        for _ in range(need):
            seq.blocks.append(self._free.pop())
        bs = self.block_size
        start = seq.length
        seq.length += new_tokens
        return [seq.blocks[i // bs] * bs + i % bs for i in range(start, seq.length)]

    def truncate(self, seq_id: object, length: int) -> None:
        """Roll ``seq_id`` back to its first ``length`` tokens, freeing unused blocks."""
        seq = self.seqs[seq_id]
        if not 0 <= length <= seq.length:
            raise ValueError(f"cannot truncate sequence {seq_id!r} of length {seq.length} to {length}")
        seq.length = length
        keep = -(-length // self.block_size)
        while len(seq.blocks) > keep:
            self._free.append(seq.blocks.pop())

    def block_lists(self, seq_ids: Sequence[object]) -> list[list[int]]:
        """Each sequence's block ids (the live lists: read, do not modify)."""
        return [self.seqs[s].blocks for s in seq_ids]

    @staticmethod
    def table_tensor(lists: Sequence[list[int]], device: torch.device) -> torch.Tensor:
        """Block lists as one ``[B, max_blocks]`` int64 tensor, padded with block 0."""
        width = max(1, max(len(b) for b in lists))
        rows = [b + [0] * (width - len(b)) if len(b) < width else b for b in lists]
        return torch.tensor(rows, dtype=torch.long, device=device)

    def block_table(self, seq_ids: Sequence[object], device: torch.device) -> torch.Tensor:
        return self.table_tensor(self.block_lists(seq_ids), device)
