"""Which member a conversation belongs to (`MemberPool.pick_affine`): its key.

A chat client resends the whole conversation every turn, so every turn starts with the same
messages up to the first user message (the system prompt, the first question and its media), in
the same tenant (`cache_salt`). Their key sends the turns to one prefill or PD member, where the
earlier turns' prefix waits in its cache. Media count by their size and a sample of their bytes:
the key only steers placement, so a rare collision costs a cache miss, never a wrong answer.
"""

from __future__ import annotations

import hashlib

from libs.contract.epd.v1 import chat_pb2, generate_pb2

SAMPLE_BYTES = 4096  # from each end of a media item's bytes


def conversation_key(request: generate_pb2.GenerateRequest) -> bytes:
    digest = hashlib.blake2b(request.cache_salt.encode("utf-8", "surrogatepass"), digest_size=16)
    for message in request.messages:
        digest.update(b"\0m%d" % message.role)
        for part in message.parts:
            if part.HasField("media"):
                media = part.media
                digest.update(b"\0i%d:%d:" % (media.modality, len(media.data)))
                digest.update(media.data[:SAMPLE_BYTES] + media.data[-SAMPLE_BYTES:])
                digest.update(media.uri.encode() + b"\0" + media.id.encode())
            else:
                digest.update(b"\0t" + part.text.encode("utf-8", "surrogatepass"))
        if message.role == chat_pb2.CHAT_ROLE_USER:
            break
    return digest.digest()
