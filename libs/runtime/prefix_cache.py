"""A bounded prefix cache for the reference engine's prefill: the KV of a prompt's leading blocks,
reused by a later prompt that starts with the same blocks. A chat client resends the whole
conversation every turn, so a conversation's next turn finds its earlier turns here, images
included, and forwards only what is new.

Keys. A block is `block_tokens` prompt positions. Its key chains the previous block's key with the
block's token ids and, for every position that holds a media item's embedding row, the item's
identity (its content hash) and the row: placeholder ids are the same for every image, their rows
are not. The chain starts from the scope: the model's weights digest and the request's cache salt
(the tenant), so one tenant's blocks never answer another tenant's prompt, and no timing tells one
tenant what another sent.

Blocks are as long as the runner's prefill chunks: a prompt that reuses k blocks then forwards
exactly the chunks a prefill from nothing would after them, the same operations on the same
inputs, so its tokens are the same bits, not merely close. Reuse leaves at least one prompt token
to forward, whose logits give the first token. A block is useful only with every block before
it, so a lookup stops at the first missing one; eviction drops the least recently used blocks
while the cache holds more than its byte budget.

Called on the one compute thread of a service (libs/serving/compute_thread.py); `stats` is read
from the event loop (plain integers).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from libs.model.families.base import PlacedItem
from libs.model.types import EncodedItem

BLOCK_TOKENS = 64  # prompt positions per block (the unit of reuse and eviction): a prefill chunk

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer, key and value [1, kv_heads, tokens, head_dim]


@dataclass
class PrefixStats:
    """Counters since start (what /metrics and the stats RPC report)."""

    queries: int = 0  # prompts looked up
    query_tokens: int = 0  # their prompt tokens
    hit_tokens: int = 0  # prompt tokens whose KV came from the cache
    stored_blocks: int = 0
    evicted_blocks: int = 0


class PrefixCache:
    def __init__(self, budget_bytes: int, *, block_tokens: int = BLOCK_TOKENS) -> None:
        if budget_bytes <= 0 or block_tokens <= 0:
            raise ValueError("a prefix cache needs a positive byte budget and block size")
        self.budget_bytes = budget_bytes
        self.block_tokens = block_tokens
        self.bytes = 0
        self.stats = PrefixStats()
        self._blocks: OrderedDict[bytes, Layers] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def keys(
        self, scope: str, input_ids: Sequence[int], items: Sequence[PlacedItem], encoded: Sequence[EncodedItem]
    ) -> list[bytes]:
        """The key of every complete block of the prompt, in order."""
        rows = _item_rows(items, encoded)
        keys: list[bytes] = []
        previous = hashlib.sha256(b"epd.prefix\0" + scope.encode("utf-8", "surrogatepass")).digest()
        for start in range(0, len(input_ids) - self.block_tokens + 1, self.block_tokens):
            digest = hashlib.sha256(previous)
            for position in range(start, start + self.block_tokens):
                digest.update(input_ids[position].to_bytes(8, "little", signed=True))
                row = rows.get(position)
                if row is not None:
                    digest.update(row)
            previous = digest.digest()
            keys.append(previous)
        return keys

    def lookup(self, keys: Sequence[bytes], prompt_tokens: int) -> tuple[int, Layers | None]:
        """The longest cached run of leading blocks (at most `prompt_tokens - 1` tokens): its token
        count and its KV, one tensor pair per layer; (0, None) on a miss."""
        self.stats.queries += 1
        self.stats.query_tokens += prompt_tokens
        usable = (prompt_tokens - 1) // self.block_tokens
        found: list[Layers] = []
        for key in keys[:usable]:
            blocks = self._blocks.get(key)
            if blocks is None:
                break
            self._blocks.move_to_end(key)
            found.append(blocks)
        if not found:
            return 0, None
        hit = len(found) * self.block_tokens
        self.stats.hit_tokens += hit
        layers = [
            (torch.cat([block[i][0] for block in found], dim=2), torch.cat([block[i][1] for block in found], dim=2))
            for i in range(len(found[0]))
        ]
        return hit, layers

    def store(self, keys: Sequence[bytes], layers: Layers) -> None:
        """Keep the blocks of a finished prefill (`layers` holds at least every keyed block's
        positions); blocks already held are only marked recently used."""
        for index, key in enumerate(keys):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            start, end = index * self.block_tokens, (index + 1) * self.block_tokens
            block = [(k[:, :, start:end].clone(), v[:, :, start:end].clone()) for k, v in layers]
            self._blocks[key] = block
            self.bytes += _nbytes(block)
            self.stats.stored_blocks += 1
        while self.bytes > self.budget_bytes and self._blocks:
            _, evicted = self._blocks.popitem(last=False)
            self.bytes -= _nbytes(evicted)
            self.stats.evicted_blocks += 1


def of_size(mib: int, block_tokens: int) -> PrefixCache | None:
    """A cache of `mib` MiB (a service's --prefix-cache-mib) in blocks of the runner's prefill
    chunks (`block_tokens`), or None for 0."""
    return PrefixCache(mib << 20, block_tokens=block_tokens) if mib > 0 else None


def _item_rows(items: Sequence[PlacedItem], encoded: Sequence[EncodedItem]) -> dict[int, bytes]:
    """Per prompt position holding an embedding row: the item's content hash and the row."""
    rows: dict[int, bytes] = {}
    for placed, item in zip(items, encoded, strict=True):
        identity = item.layout.mm_hash.encode()
        row = 0
        for start, count in placed.row_spans():
            for offset in range(count):
                rows[start + offset] = identity + (row + offset).to_bytes(4, "little")
            row += count
    return rows


def _nbytes(block: Layers) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in block)
