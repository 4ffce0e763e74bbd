"""The golden requests from a client host (run inside its namespace): prints {mix: token ids}.

ip netns exec NS python -m tests.multihost.client ROUTER_ADDRESS MIX [MIX ...]
"""

from __future__ import annotations

import asyncio
import json
import sys

from libs.client.generate import generate, open_channel
from tests.support.golden import ALL_MODALITIES, request_for
from tests.support.mixes import mixes


async def main(address: str, names: list[str]) -> dict[str, list[int]]:
    by_name = {mix.name: mix for mix in mixes(ALL_MODALITIES)}
    async with open_channel(address) as channel:
        results = await asyncio.gather(
            *(generate(channel, request_for(by_name[n], request_id=f"multihost-{n}"), timeout_s=120) for n in names)
        )
    return {name: result.token_ids for name, result in zip(names, results, strict=True)}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2:]))))
