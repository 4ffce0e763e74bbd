"""Chat messages → token ids, with each media item's placeholder expanded to its embedding rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from libs.model.errors import EmbeddingMismatchError, InvalidRequestError, UnsupportedModalityError
from libs.model.families.base import FamilyAdapter, PlacedItem
from libs.model.types import ChatMessage, ChatRole, EncodedItem, EncodedPart, TextPart


@dataclass
class Prompt:
    input_ids: list[int]
    items: list[PlacedItem]  # in prompt order
    encoded: list[EncodedItem]  # same order as `items`


def prompt_ids(tokenizer: Any, messages: list[ChatMessage], conversation: list[dict[str, Any]]) -> list[int]:
    """The conversation through the model's chat template; a raw prompt (one RAW message of text,
    contract 1.6) tokenized as it is, with the tokenizer's special tokens, as vLLM's completions do."""
    if any(message.role is ChatRole.RAW for message in messages):
        if len(messages) != 1:
            raise InvalidRequestError("a raw prompt is the only message of its request", field="messages")
        if not all(isinstance(part, TextPart) for part in messages[0].parts):
            raise InvalidRequestError("a raw prompt holds text parts only", field="messages[0].parts")
        ids: list[int] = tokenizer.encode("".join(p.text for p in messages[0].parts if isinstance(p, TextPart)))
        return ids
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    templated: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return templated


def build_prompt(tokenizer: Any, adapter: FamilyAdapter, messages: list[ChatMessage]) -> Prompt:
    if not messages:
        raise InvalidRequestError("at least one message is required", field="messages")
    placeholder_ids = {
        int(tokenizer.convert_tokens_to_ids(adapter.placeholder_token(m))): m for m in adapter.modalities
    }
    reserved = [adapter.placeholder_token(m) for m in adapter.modalities]
    conversation: list[dict[str, Any]] = []
    encoded: list[EncodedItem] = []
    for i, message in enumerate(messages):
        content: list[dict[str, Any]] = []
        for j, part in enumerate(message.parts):
            if isinstance(part, TextPart):
                if any(token in part.text for token in reserved):
                    raise InvalidRequestError(
                        "text contains a reserved placeholder token", field=f"messages[{i}].parts[{j}].text"
                    )
                content.append({"type": "text", "text": part.text})
            elif isinstance(part, EncodedPart):
                part.item.layout.check()
                if part.item.layout.modality not in adapter.modalities:
                    raise UnsupportedModalityError(
                        f"model has no {part.item.layout.modality.value} input",
                        field=f"messages[{i}].parts[{j}].encoded",
                    )
                content.append({"type": adapter.content_type(part.item.layout.modality)})
                encoded.append(part.item)
            else:
                raise InvalidRequestError("unknown content part", field=f"messages[{i}].parts[{j}]")
        conversation.append({"role": message.role.value, "content": content})
    raw_ids = prompt_ids(tokenizer, messages, conversation)

    input_ids: list[int] = []
    items: list[PlacedItem] = []
    next_item = 0
    absorb_next: int | None = None  # a template token the previous expansion already replaced
    for token in raw_ids:
        pending, absorb_next = absorb_next, None
        if token == pending:
            continue
        modality = placeholder_ids.get(token)
        if modality is None:
            input_ids.append(token)
            continue
        if next_item >= len(encoded) or encoded[next_item].layout.modality is not modality:
            raise InvalidRequestError("placeholders do not match the media parts", field="messages")
        layout = encoded[next_item].layout
        expansion = adapter.expand_placeholder(layout, token, tokenizer)
        before, absorb_next = expansion.absorb
        if before is not None and input_ids and input_ids[-1] == before:
            input_ids.pop()
        spans = tuple((len(input_ids) + offset, rows) for offset, rows in expansion.spans)
        if sum(rows for _, rows in spans) != layout.placeholder_token_count:
            raise EmbeddingMismatchError(
                "layout grid does not match placeholder_token_count", field="layout.placeholder_token_count"
            )
        items.append(PlacedItem(start=spans[0][0], layout=layout, spans=spans))
        input_ids.extend(expansion.tokens)
        next_item += 1
    if next_item != len(encoded):
        raise InvalidRequestError("chat template dropped a media part", field="messages")
    return Prompt(input_ids=input_ids, items=items, encoded=encoded)


def speech_item(family: str, messages: list[ChatMessage]) -> tuple[str, EncodedItem]:
    """The conversation's one item and its field path; text parts are refused (no text prompt)."""
    if not messages:
        raise InvalidRequestError("at least one message is required", field="messages")
    items: list[tuple[str, EncodedItem]] = []
    for i, message in enumerate(messages):
        for j, part in enumerate(message.parts):
            field = f"messages[{i}].parts[{j}]"
            if isinstance(part, EncodedPart):
                part.item.layout.check()
                items.append((field, part.item))
            elif part.text:
                raise InvalidRequestError(f"{family} takes no text prompt", field=f"{field}.text")
    if len(items) != 1:
        raise InvalidRequestError(f"{family} takes exactly one audio item, got {len(items)}", field="messages")
    return items[0]
