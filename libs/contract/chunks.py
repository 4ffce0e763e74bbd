"""Token chunks merged: a `TokenChunk` holds the tokens "generated since the previous chunk", so
two consecutive chunks of one stream say the same as one chunk holding both. A hop whose reader
lags (the router relaying decode's stream, the OpenAI door writing SSE) merges what queued up
instead of writing one message per token (`libs/rpc/coalesce.py`)."""

from __future__ import annotations

from libs.contract.epd.v1 import generate_pb2, generation_pb2


def merge_chunks(earlier: generation_pb2.TokenChunk, later: generation_pb2.TokenChunk) -> generation_pb2.TokenChunk:
    """One chunk saying what `earlier` then `later` say: their tokens, text and log-probabilities in
    order; the finish reason only `later` can carry (a stream's last chunk ends it)."""
    merged = generation_pb2.TokenChunk()
    merged.CopyFrom(earlier)
    merged.token_ids.extend(later.token_ids)
    merged.text += later.text
    merged.logprobs.extend(later.logprobs)
    merged.finish_reason = later.finish_reason
    return merged


Reply = tuple[generation_pb2.TokenChunk, generation_pb2.Usage | None]


def merge_replies(earlier: Reply, later: Reply) -> Reply:
    """(chunk, usage) pairs as a stage streams them: usage comes with the last chunk."""
    return merge_chunks(earlier[0], later[0]), later[1] if later[1] is not None else earlier[1]


def merge_responses(
    earlier: generate_pb2.GenerateResponse, later: generate_pb2.GenerateResponse
) -> generate_pb2.GenerateResponse:
    """Two `Generate` responses of one stream as one (the request id is the stream's)."""
    merged = generate_pb2.GenerateResponse(request_id=later.request_id or earlier.request_id)
    merged.chunk.CopyFrom(merge_chunks(earlier.chunk, later.chunk))
    if later.HasField("usage"):
        merged.usage.CopyFrom(later.usage)
    elif earlier.HasField("usage"):
        merged.usage.CopyFrom(earlier.usage)
    return merged
