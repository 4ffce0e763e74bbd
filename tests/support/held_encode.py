"""Run an encoder that holds some of its Encode calls until it dies, so a kill provably costs work:
`python -m tests.support.held_encode PREFIX MODULE [ARGS...]` runs `MODULE` (services.encoder,
unchanged) with every Encode call of a request id starting with PREFIX admitted and then held:
it never returns. Other calls (the router's warm-up, probes) are served as usual. A test kills
the process once its stats show a held call in flight; the router must move that work elsewhere.
Only a test harness: nothing ships it."""

from __future__ import annotations

import asyncio
import runpy
import sys

from libs.contract.epd.v1 import encoder_pb2
from services.encoder.core import EncoderCore


def hold_encodes(prefix: str) -> None:
    """Patch `EncoderCore.encode`: calls whose request id starts with `prefix` wait forever."""
    encode = EncoderCore.encode

    async def held(self: EncoderCore, request: encoder_pb2.EncodeRequest) -> encoder_pb2.EncodeResponse:
        if request.request_id.startswith(prefix):
            await asyncio.Event().wait()  # until the process is killed
        return await encode(self, request)

    EncoderCore.encode = held  # type: ignore[method-assign]


if __name__ == "__main__":
    hold_encodes(sys.argv[1])
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
