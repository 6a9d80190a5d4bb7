"""What attention needs to know about one step's flat batch. Built once per step, shared by all layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ruvllm.attention.kv_quant import KVTier


@dataclass(slots=True)
class ColdGather:
    """How to read a gathered run of blocks when some are cold (a quantized KV cache): gather
    `hot_table` from the hot cache (cold entries replaced by block 0), then overwrite the entries at
    `cold_at` with the dequantized cold blocks `cold_ids` (cold-tier block indices), and fake-quantize
    the hot blocks at `fq_at` (their tokens are old enough to be read as cold, but they have not moved)."""

    hot_table: torch.Tensor  # same shape as the table it replaces
    cold_at: torch.Tensor  # [n] positions in the flattened table
    cold_ids: torch.Tensor  # [n]
    fq_at: torch.Tensor  # [m] positions in the flattened table (decodes; for prompt chunks see PrefillSeq)


@dataclass(slots=True)
class PrefillSeq:
    """A sequence contributing more than one query token this step (a prompt chunk)."""

    token_start: int  # its query rows in the flat batch: [token_start, token_end)
    token_end: int
    context_slots: torch.Tensor  # [context_len] cache slots of every key it attends to, in order
    mask: torch.Tensor | None  # [q, context_len] bool, or None when the chunk is the whole causal context
    # With a quantized KV cache: the context's blocks, read through `cold`; its `fq_at` blocks are
    # appended once more, fake-quantized, after the context_len keys, and `mask` ([q, context_len +
    # len(fq_at) * block_size]) lets each row see either the exact or the fake-quantized copy.
    cold: ColdGather | None = None


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's key/value is written to
    # Sequences with one query token (decodes), attended in one padded batch.
    decode_rows: torch.Tensor | None  # [B] their rows in the flat batch
    # [B, max_blocks] block tables (padding: block 0). Keys are gathered a whole block at a time:
    # one index per block_size tokens is several times cheaper than one index per token.
    decode_block_tables: torch.Tensor | None
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] True where a key is real
    prefills: list[PrefillSeq]
    block_size: int = 16
    # Per query row, for kernels that read the cache in place: the row's sequence (its row in
    # block_tables) and how many keys it attends to (its position + 1). block_tables: [S, max_blocks].
    block_tables: torch.Tensor | None = None
    row_seq: torch.Tensor | None = None
    row_ctx: torch.Tensor | None = None
    # Tiles of consecutive query rows of one sequence, for kernels that take several rows per
    # program (the Triton kernel): each tile's sequence, first flat row and number of rows.
    tile_seq: torch.Tensor | None = None
    tile_start: torch.Tensor | None = None
    tile_len: torch.Tensor | None = None
    num_tiles: int = 0
    # A quantized KV cache: which block ids are cold and which keys each query reads dequantized.
    tier: KVTier | None = None
    decode_cold: ColdGather | None = None  # the decodes' block tables through the cold tier
    # Sliding-window layers: a query at p sees keys p - window + 1 .. p (0: all of its context).
    # Blocks wholly before a query's window may be placeholders: they are never read.
    window: int = 0
    # A model with several KV groups (kv_groups.py): each group's metadata, this one first; a
    # layer reads its group's. None: one group, this metadata.
    by_group: list[AttentionMetadata] | None = None


def cold_gather(table: list[list[int]], ctx_lens: list[int], block_size: int, tier: KVTier,
                device: torch.device | str) -> ColdGather:
    """Reads of the blocks in `table` (rows padded with block 0) for queries at position ctx - 1:
    which entries are cold, and which hot entries are old enough to be read fake-quantized."""
    t = torch.tensor(table, dtype=torch.long)
    flat = t.reshape(-1)
    is_cold = flat >= tier.num_hot_blocks
    j = torch.arange(t.shape[1]).unsqueeze(0)
    old = ((j + 1) * block_size <= torch.tensor(ctx_lens).unsqueeze(1) - tier.hot_tokens).reshape(-1)
    cold_at = is_cold.nonzero().flatten()
    return ColdGather(
        hot_table=torch.where(is_cold, 0, flat).view(t.shape).to(device),
        cold_at=cold_at.to(device),
        cold_ids=(flat[cold_at] - tier.num_hot_blocks).to(device),
        fq_at=(old & ~is_cold).nonzero().flatten().to(device),
    )


def _tiered_prefill(row: int, num_q: int, ctx_len: int, table: list[int], block_size: int, tier: KVTier,
                    device: torch.device | str) -> PrefillSeq:
    """A prompt chunk over a quantized cache: row at position p reads block i fake-quantized (or
    dequantized from the cold tier) when (i + 1) * block_size <= p + 1 - hot_tokens."""
    nblk = len(table)
    gather = cold_gather([table], [ctx_len], block_size, tier, "cpu")  # fq_at: blocks old for the last row
    pos = torch.arange(ctx_len - num_q, ctx_len).unsqueeze(1)  # [q, 1]
    key = torch.arange(nblk * block_size)[:ctx_len].unsqueeze(0)
    old_for_row = (key // block_size + 1) * block_size <= pos + 1 - tier.hot_tokens  # [q, ctx]
    has_fq_copy = torch.zeros(nblk, dtype=torch.bool)
    has_fq_copy[gather.fq_at] = True
    exact = (key <= pos) & ~(old_for_row & has_fq_copy[key // block_size])
    fq_blocks = gather.fq_at
    fq_keys = (fq_blocks.unsqueeze(1) * block_size + torch.arange(block_size)).reshape(1, -1)
    fq_visible = (fq_keys // block_size + 1) * block_size <= pos + 1 - tier.hot_tokens
    mask = torch.cat([exact, fq_visible], 1)
    slots = torch.empty(0, dtype=torch.long)
    return PrefillSeq(row, row + num_q, slots, mask.to(device),
                      ColdGather(gather.hot_table.to(device), gather.cold_at.to(device),
                                 gather.cold_ids.to(device), fq_blocks.to(device)))


def build_attention_metadata(
    seqs: list[tuple[int, int, list[int]]],  # (num_query_tokens, context_len_after_step, block_table)
    block_size: int,
    device: torch.device | str = "cpu",
    tier: KVTier | None = None,
    window: int = 0,
) -> AttentionMetadata:
    """Slot mapping and per-sequence key gathers for a flat batch laid out in the order of `seqs`;
    with `window`, the masks hide keys before each query's window."""
    slot_chunks: list[torch.Tensor] = []
    decode_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefills: list[PrefillSeq] = []
    row = 0
    for num_q, ctx_len, block_table in seqs:
        blocks = torch.tensor(block_table[: (ctx_len + block_size - 1) // block_size], dtype=torch.long)
        slots = (blocks.unsqueeze(1) * block_size + torch.arange(block_size)).reshape(-1)[:ctx_len]
        slot_chunks.append(slots[ctx_len - num_q:])
        if num_q == 1:
            decode_rows.append(row)
            decode_tables.append(block_table[: (ctx_len + block_size - 1) // block_size])
            decode_lens.append(ctx_len)
        elif tier is not None:
            prefills.append(_tiered_prefill(row, num_q, ctx_len, block_table[: (ctx_len + block_size - 1) // block_size],
                                            block_size, tier, device))
        else:
            if ctx_len == num_q and not (window and window < ctx_len):
                mask = None  # plain causal attention over the chunk itself
            else:
                q_pos = torch.arange(ctx_len - num_q, ctx_len).unsqueeze(1)
                key = torch.arange(ctx_len).unsqueeze(0)
                mask = key <= q_pos
                if window:
                    mask &= key > q_pos - window
                mask = mask.to(device)
            prefills.append(PrefillSeq(row, row + num_q, slots.to(device), mask))
        row += num_q
    slot_mapping = torch.cat(slot_chunks).to(device) if slot_chunks else torch.empty(0, dtype=torch.long)

    if decode_rows:
        max_blocks = max(len(t) for t in decode_tables)
        tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in decode_tables], dtype=torch.long)
        lens = torch.tensor(decode_lens, dtype=torch.long)
        key = torch.arange(max_blocks * block_size).unsqueeze(0)
        mask = key < lens.unsqueeze(1)
        if window:
            mask &= key >= lens.unsqueeze(1) - window
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            decode_rows=torch.tensor(decode_rows, dtype=torch.long, device=device),
            decode_block_tables=tables.to(device),
            decode_mask=mask[:, None, None, :].to(device),
            prefills=prefills,
            block_size=block_size,
            tier=tier,
            decode_cold=None if tier is None else cold_gather(tables.tolist(), decode_lens, block_size, tier, device),
            window=window,
        )
    return AttentionMetadata(slot_mapping, None, None, None, prefills, block_size, tier=tier, window=window)


def build_paged_kernel_metadata(
    seqs: list[tuple[int, int, list[int]]],  # (num_query_tokens, context_len_after_step, block_table)
    block_size: int,
    device: torch.device | str = "cpu",
    tile_tokens: int = 0,
    window: int = 0,
) -> AttentionMetadata:
    """What a kernel reading the cache in place needs: slots to write, and per query row its
    sequence and context length. No per-step gathers or masks are built. With `tile_tokens`, also
    the tiles of at most that many consecutive query rows of one sequence."""
    tables = [t[: (ctx + block_size - 1) // block_size] for _, ctx, t in seqs]
    width = max((len(t) for t in tables), default=0)
    slots: list[int] = []
    row_seq: list[int] = []
    row_ctx: list[int] = []
    tiles: list[tuple[int, int, int]] = []
    for i, ((num_q, ctx, _), table) in enumerate(zip(seqs, tables)):
        if tile_tokens:
            first = len(row_seq)
            tiles.extend((i, first + s, min(tile_tokens, num_q - s)) for s in range(0, num_q, tile_tokens))
        row_seq.extend([i] * num_q)
        row_ctx.extend(range(ctx - num_q + 1, ctx + 1))
        slots.extend(table[pos // block_size] * block_size + pos % block_size for pos in range(ctx - num_q, ctx))

    def tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=tensor(slots),
        decode_rows=None, decode_block_tables=None, decode_mask=None, prefills=[], block_size=block_size,
        block_tables=tensor([t + [0] * (width - len(t)) for t in tables]),
        row_seq=tensor(row_seq),
        row_ctx=tensor(row_ctx),
        window=window,
    )
    if tile_tokens:
        meta.tile_seq, meta.tile_start, meta.tile_len = (tensor([t[j] for t in tiles]) for j in range(3))
        meta.num_tiles = len(tiles)
    return meta
