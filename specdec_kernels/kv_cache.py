"""Paged KV cache for all layers of a model: block allocation, block table, lengths.

Layout (what ``specdec::tree_attention`` and ``specdec::compact_kv`` take)::

    k_caches[layer], v_caches[layer]   [num_blocks, block_size, num_kv_heads, head_dim]
    block_table                        int32 [max_batch, max_blocks_per_seq], -1 padded
    lengths                            int32 [max_batch], committed tokens per slot

Cache position ``p`` of the request in slot ``s`` lives in block
``block_table[s, p // block_size]`` at offset ``p % block_size``; its flat index into
``k_caches[layer].view(-1, num_kv_heads, head_dim)`` is ``block * block_size + offset``.
Unused entries of the block table are -1 (the package's padding); kernels only read the
entries that cover the positions they touch. A contiguous cache
(:meth:`PagedKVCache.contiguous`) is the special case block_size = max_len with one block
per request.

One decoding step of a request in slot ``s`` with committed length ``L``:

1. ``append_slots([s], [n])`` reserves blocks for ``n`` new tokens (for a tree: its
   ``N`` nodes, node 0 being the root, the last verified token, at position ``L``) and
   returns their cache positions ``L .. L+n-1`` and flat slot indices;
2. ``write(layer, slot_mapping, k, v)`` stores the new tokens' K/V for each layer;
3. attention reads ``batch_view(slots)`` = (block_table rows, prefix_lens = lengths);
4. after acceptance, ``compact(slots, accepted_nodes, num_accepted)`` moves the accepted
   nodes to ``L+1 ..`` (``specdec::compact_kv``) and commits ``1 + num_accepted`` tokens
   (the root plus the accepted nodes); a chain is committed with ``commit`` alone.

The allocator bookkeeping (free blocks, blocks per slot, lengths) is kept on the host as
Python ints, mirrored into the device tensors ``block_table`` and ``lengths`` whenever it
changes, so kernels never need a host sync and the host never reads the device except in
``compact``/``commit`` when given device tensors (the decode loop syncs there anyway to
read the accepted tokens). Blocks reserved beyond the committed length stay with the
request (the next step reuses them) until ``free``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["AppendSlots", "OutOfBlocksError", "PagedKVCache"]


class OutOfBlocksError(RuntimeError):
    """No free block is left (the decode loop may preempt a request and retry)."""


@dataclass
class AppendSlots:
    """Where the new tokens of a batch go (request b owns rows qo_indptr[b]:qo_indptr[b+1]).

    cache_positions: int32 [T], position of each new token in its request's sequence.
    slot_mapping: int64 [T], flat index block * block_size + offset (int64 because it
        indexes ``index_copy_``, which takes int64 indices).
    qo_indptr: int32 [B+1], row offsets of the requests.
    """

    cache_positions: torch.Tensor
    slot_mapping: torch.Tensor
    qo_indptr: torch.Tensor


def _to_int_list(values, n: int, name: str) -> list[int]:
    """An int, a sequence or a tensor of ``n`` ints as a Python list (a tensor is read
    from the device: one sync)."""
    if isinstance(values, int):
        return [values] * n
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    values = [int(v) for v in values]
    if len(values) != n:
        raise ValueError(f"{name} must have one entry per slot ({n}), got {len(values)}")
    return values


class PagedKVCache:
    """K and V caches of every layer in fixed-size blocks, shared by up to ``max_batch``
    requests (one slot each).

    Attributes: ``k_caches``, ``v_caches`` (lists of ``num_layers`` tensors
    [num_blocks, block_size, num_kv_heads, head_dim]); ``block_table`` int32
    [max_batch, max_blocks_per_seq] (-1 padded); ``lengths`` int32 [max_batch] (committed
    tokens; 0 for a free slot). All on ``device``.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        num_blocks: int,
        block_size: int,
        max_batch: int,
        max_blocks_per_seq: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in [
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("max_batch", max_batch),
            ("max_blocks_per_seq", max_blocks_per_seq),
        ]:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_blocks_per_seq = max_blocks_per_seq
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.block_table = torch.full((max_batch, max_blocks_per_seq), -1, dtype=torch.int32, device=self.device)
        self.lengths = torch.zeros(max_batch, dtype=torch.int32, device=self.device)
        # Host bookkeeping. Free lists are stacks, reversed so that block 0 / slot 0 go first.
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self._scratch_blocks = 0
        self._free_slots = list(range(max_batch - 1, -1, -1))
        self._blocks: dict[int, list[int]] = {}  # slot -> its blocks, in sequence order
        self._lengths: dict[int, int] = {}  # slot -> committed tokens

    @classmethod
    def contiguous(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        max_batch: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> "PagedKVCache":
        """One block of ``max_len`` positions per request (block_size = max_len,
        max_blocks_per_seq = 1): the layout of a plain [B, max_len, H, D] cache."""
        return cls(
            num_layers,
            num_kv_heads,
            head_dim,
            num_blocks=max_batch,
            block_size=max_len,
            max_batch=max_batch,
            max_blocks_per_seq=1,
            dtype=dtype,
            device=device,
        )

    # ----------------------------------------------------------------- bookkeeping
    @property
    def max_len(self) -> int:
        """Most positions one request can hold."""
        return self.block_size * self.max_blocks_per_seq

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def num_scratch_blocks(self) -> int:
        """Blocks held as scratch space (``take_blocks``), never a slot's."""
        return self._scratch_blocks

    @property
    def active_slots(self) -> list[int]:
        return sorted(self._blocks)

    def length(self, slot: int) -> int:
        """Committed tokens of the request in ``slot`` (host int)."""
        self._check_slot(slot)
        return self._lengths[slot]

    def capacity(self, slot: int) -> int:
        """Positions covered by the blocks ``slot`` holds now."""
        self._check_slot(slot)
        return len(self._blocks[slot]) * self.block_size

    def _check_slot(self, slot: int) -> None:
        if slot not in self._blocks:
            raise ValueError(f"slot {slot} holds no request (active slots: {self.active_slots})")

    def add_request(self, num_tokens: int = 0) -> int:
        """Take a free slot, reserve blocks for ``num_tokens`` (e.g. the prompt) and return
        the slot (its length is 0 until ``commit``)."""
        if not self._free_slots:
            raise OutOfBlocksError(f"all {self.max_batch} slots are in use")
        slot = self._free_slots.pop()
        self._blocks[slot] = []
        self._lengths[slot] = 0
        try:
            self.reserve([slot], [num_tokens])
        except Exception:
            self.free(slot)
            raise
        return slot

    def take_blocks(self, count: int) -> torch.Tensor:
        """Take ``count`` free blocks out of the pool for good: scratch space its caller
        addresses itself (a drafter's copies of draft paths), never handed to a slot.
        Returns their indices, int64 [count]; OutOfBlocksError when fewer are free."""
        if count > len(self._free_blocks):
            raise OutOfBlocksError(f"need {count} scratch blocks, {len(self._free_blocks)} free")
        taken = [self._free_blocks.pop() for _ in range(count)]
        self._scratch_blocks += count
        return torch.tensor(taken, dtype=torch.int64, device=self.device)

    def reserve(self, slots: Sequence[int], num_new: Sequence[int] | int) -> None:
        """Make sure the request in each slot has room for ``num_new`` tokens past its
        committed length (allocating blocks; existing extra blocks are reused).

        Raises ValueError past ``max_len`` and OutOfBlocksError when blocks run out (then
        nothing is allocated for any slot of this call)."""
        slots = list(slots)
        num_new = _to_int_list(num_new, len(slots), "num_new")
        needed: list[tuple[int, int]] = []  # (slot, blocks to add)
        for slot, n in zip(slots, num_new):
            self._check_slot(slot)
            if n < 0:
                raise ValueError(f"num_new must be >= 0, got {n} for slot {slot}")
            total = self._lengths[slot] + n
            if total > self.max_len:
                raise ValueError(
                    f"slot {slot}: {self._lengths[slot]} committed + {n} new tokens exceed max_len {self.max_len}"
                )
            blocks_needed = -(-total // self.block_size) - len(self._blocks[slot])
            if blocks_needed > 0:
                needed.append((slot, blocks_needed))
        total_needed = sum(n for _, n in needed)
        if total_needed > len(self._free_blocks):
            raise OutOfBlocksError(f"need {total_needed} blocks, {len(self._free_blocks)} free")
        for slot, count in needed:
            start = len(self._blocks[slot])
            new_blocks = [self._free_blocks.pop() for _ in range(count)]
            self._blocks[slot].extend(new_blocks)
            self.block_table[slot, start : start + count] = torch.tensor(new_blocks, dtype=torch.int32)

    def append_slots(self, slots: Sequence[int], num_new: Sequence[int] | int) -> AppendSlots:
        """Reserve room for ``num_new[b]`` tokens after the committed tokens of ``slots[b]``
        and return where they go: positions ``L_b .. L_b + num_new[b] - 1`` (the tree
        layout: node j at ``prefix_len + j``). Nothing is committed."""
        positions, flat, indptr = self.plan_append(slots, num_new)
        return AppendSlots(
            cache_positions=torch.tensor(positions, dtype=torch.int32, device=self.device),
            slot_mapping=torch.tensor(flat, dtype=torch.int64, device=self.device),
            qo_indptr=torch.tensor(indptr, dtype=torch.int32, device=self.device),
        )

    def plan_append(self, slots: Sequence[int], num_new: Sequence[int] | int) -> tuple[list, list, list]:
        """:meth:`append_slots` as host lists: (positions [T], flat slot mapping [T],
        qo_indptr [B+1]) — for a caller that hands them to C++ as integers."""
        slots = list(slots)
        num_new = _to_int_list(num_new, len(slots), "num_new")
        self.reserve(slots, num_new)
        # Host lists: this runs every decode step, and per-slot tensor arithmetic cost ~90 us
        # of Python a step.
        positions, flat, indptr = [], [], [0]
        bs = self.block_size
        for slot, n in zip(slots, num_new):
            start, blocks = self._lengths[slot], self._blocks[slot]
            positions.extend(range(start, start + n))
            flat.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            indptr.append(indptr[-1] + n)
        return positions, flat, indptr

    def slot_mapping(self, slot: int, positions: torch.Tensor) -> torch.Tensor:
        """Flat cache indices (int64, block * block_size + offset) of ``positions`` (int64)
        of the request in ``slot``, read from the device block table (the blocks must be
        reserved)."""
        bs = self.block_size
        blocks = self.block_table[slot].to(torch.int64)[positions // bs]
        return blocks * bs + positions % bs

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the K/V of new tokens of one layer.

        slot_mapping: int64 [T] (``AppendSlots.slot_mapping``); k, v: [T, num_kv_heads,
        head_dim], cast to the cache dtype (for a uint8 cache the caller passes uint8)."""
        shape = (slot_mapping.shape[0], self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
        flat_shape = (self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        self.k_caches[layer].view(flat_shape).index_copy_(0, slot_mapping, k.to(self.dtype))
        self.v_caches[layer].view(flat_shape).index_copy_(0, slot_mapping, v.to(self.dtype))

    def batch_view(self, slots: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_table int32 [B, max_blocks_per_seq], prefix_lens int32 [B]) of ``slots``,
        as the attention and compaction ops take them; prefix_lens = committed lengths."""
        table, lengths = self.host_view(slots)
        return (torch.tensor(table, dtype=torch.int32, device=self.device).view(len(lengths), self.max_blocks_per_seq),
                torch.tensor(lengths, dtype=torch.int32, device=self.device))

    def host_view(self, slots: Sequence[int] | torch.Tensor) -> tuple[list, list]:
        """:meth:`batch_view` as host lists: (block table rows, flat, B * max_blocks_per_seq;
        prefix_lens [B]). From the host bookkeeping (the device tensors mirror it): no reads
        of the device ones; this runs every step."""
        slots = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        width = self.max_blocks_per_seq
        table = []
        for slot in slots:
            if not 0 <= slot < self.max_batch:
                raise IndexError(f"slot {slot} is out of range [0, {self.max_batch})")
            blocks = self._blocks.get(slot, [])
            table.extend(blocks)
            table.extend([-1] * (width - len(blocks)))
        return table, [self._lengths.get(s, 0) for s in slots]

    def commit(self, slots: Sequence[int], num_tokens: Sequence[int] | torch.Tensor | int) -> None:
        """Add ``num_tokens[b]`` to the committed length of ``slots[b]`` (they must already
        be written at the following positions, within the reserved blocks)."""
        slots = list(slots)
        num_tokens = _to_int_list(num_tokens, len(slots), "num_tokens")
        for slot, n in zip(slots, num_tokens):
            self._check_slot(slot)
            if n < 0 or self._lengths[slot] + n > self.capacity(slot):
                raise ValueError(
                    f"slot {slot}: cannot commit {n} tokens past length {self._lengths[slot]} "
                    f"(reserved capacity {self.capacity(slot)})"
                )
        for slot, n in zip(slots, num_tokens):
            self._lengths[slot] += n
        if slots:
            index = torch.tensor(slots, dtype=torch.int64, device=self.device)
            values = torch.tensor([self._lengths[s] for s in slots], dtype=torch.int32, device=self.device)
            self.lengths.index_copy_(0, index, values)

    def compact(self, slots: Sequence[int], accepted_nodes: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """After tree verification: move the accepted nodes next to the root in every layer
        (``specdec::compact_kv``) and commit the root plus the accepted nodes.

        accepted_nodes: int32 [B, D] (strictly increasing node indices, -1 padded, as
        ``tree_rejection_sample`` returns them); num_accepted: int32 [B]. A request with
        num_accepted = -1 (the samplers' NaN-row result) moves and commits nothing.
        Reads num_accepted on the host (one sync) to update the lengths."""
        from .ops import compact_kv  # late import: ops imports nothing from here

        slots = list(slots)
        roots_only = accepted_nodes.dim() == 2 and tuple(accepted_nodes.shape) == (len(slots), 0)
        if not roots_only:  # (roots alone, an autoregressive step, have nothing to move)
            block_table, prefix_lens = self.batch_view(slots)
            compact_kv(self.k_caches, self.v_caches, block_table, prefix_lens, accepted_nodes, num_accepted)
        counts = _to_int_list(num_accepted, len(slots), "num_accepted")
        if roots_only and any(n not in (0, -1) for n in counts):
            raise ValueError(f"num_accepted must be 0 or -1 where no nodes were drafted, got {counts}")
        self.commit(slots, [1 + n if n >= 0 else 0 for n in counts])

    def free(self, slot: int) -> None:
        """Release the request in ``slot``: its blocks and the slot go back to the free
        lists (the cache contents are left as they are)."""
        self._check_slot(slot)
        blocks = self._blocks.pop(slot)
        del self._lengths[slot]
        self._free_blocks.extend(reversed(blocks))
        self._free_slots.append(slot)
        self.block_table[slot].fill_(-1)
        self.lengths[slot] = 0
