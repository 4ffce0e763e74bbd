"""Which media items each prefill / PD member holds in its prefix cache, as far as the router saw
them go there, so a conversation's next turn on that member needs no encoder (contract 1.9,
`EncodedMedia.prefix_held`).

- `remember`: a member answered a request (its first token came back): each of the request's
  media items, named by its content hash within the request's tenant (`libs.model.content.scoped`:
  never shared across tenants), is now in that member's cache, with the layout its encoder gave.
- `plan`: before a request's encodes, for each of its media items the router saw go to the member
  its conversation's last turn went to, the item's layout. When the request goes to that member
  again (the router then chooses it before the encodes, services/router/core.py), those items go
  as `prefix_held` parts: no encoder runs and the member reads nothing. The items are hashed only
  when that member advertises `prefix.held_items` and the router knows of items it holds.
- `forget`: the member answered EMBEDDING_NEEDED (it evicted the prefix, restarted, or the item lay
  past what it caches): the router encodes and retries, and stops assuming that member holds them.

The router's memory is a hint, never trusted for correctness: a member checks that its cache covers
every row of a held item before it uses it. Bounded: the latest `CAPACITY` (member, item) pairs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from opentelemetry import metrics

from libs.contract.epd.v1 import chat_pb2, layout_pb2
from libs.contract.validation import HELD_ITEMS_CAPABILITY
from libs.model import content
from services.router.cache_lookup import item_hash
from services.router.stubs import Checks

CAPACITY = 65536  # (member, item) pairs remembered (~300 bytes each)


@dataclass
class HeldPlan:
    """The member a request goes to (chosen before its encodes; None: chosen at the call), and the
    layouts of the items it holds already, by the request's media item index. True when it holds
    some: the request then goes to that member only."""

    member: str | None = None
    layouts: dict[int, layout_pb2.ItemLayout] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.layouts)


class HeldItems:
    """The router's memory of what each member's prefix cache holds (one event loop)."""

    def __init__(self, checks: Checks, capacity: int = CAPACITY) -> None:
        self._checks = checks
        self._capacity = capacity
        self._held: OrderedDict[tuple[str, str], layout_pb2.ItemLayout] = OrderedDict()
        self._misses = metrics.get_meter("epd").create_counter(
            "epd.router.held_misses", description="Requests whose member no longer held the items sent as held"
        )

    def __len__(self) -> int:
        return len(self._held)

    def remember(self, member: str, salt: str, messages: Sequence[chat_pb2.ChatMessage]) -> None:
        """`member` served these messages: their items are in its cache (when it keeps them)."""
        if not self._checks.honors(member, HELD_ITEMS_CAPABILITY):
            return
        for part in _encoded(messages):
            layout = part.encoded.layout
            if layout.cross_attention_rows:  # encoder-decoder states: no prompt positions to cache
                continue
            key = (member, content.scoped(layout.mm_hash, salt))
            self._held[key] = layout
            self._held.move_to_end(key)
        while len(self._held) > self._capacity:
            self._held.popitem(last=False)

    def forget(self, member: str, salt: str, layouts: Sequence[layout_pb2.ItemLayout]) -> None:
        """`member` answered EMBEDDING_NEEDED for a request holding these items."""
        self._misses.add(1)
        for layout in layouts:
            self._held.pop((member, content.scoped(layout.mm_hash, salt)), None)

    async def plan(
        self, member: str | None, salt: str, media: Sequence[chat_pb2.ContentPart], max_bytes: int
    ) -> HeldPlan:
        """The plan for a request going to `member`: which of its media parts (`media`, in item
        order) that member holds."""
        if member is None or not media or not self._held or not self._checks.honors(member, HELD_ITEMS_CAPABILITY):
            return HeldPlan(member)
        layouts: dict[int, layout_pb2.ItemLayout] = {}
        for index, part in enumerate(media):
            digest = await item_hash(part.media, max_bytes)
            held = None if digest is None else self._held.get((member, content.scoped(digest, salt)))
            if held is not None:
                layout = layout_pb2.ItemLayout()
                layout.CopyFrom(held)
                layout.item_index = index  # its place in this request
                layouts[index] = layout
        return HeldPlan(member, layouts)


def _encoded(messages: Sequence[chat_pb2.ChatMessage]) -> list[chat_pb2.ContentPart]:
    return [part for message in messages for part in message.parts if part.HasField("encoded")]


class HeldMemberLeft(Exception):
    """The member holding a request's held items could not take it (it drains, stopped, or cannot
    be reached): the router encodes the items and sends the request anywhere."""
