"""The vLLM engine tests' requests from a client host (run inside its namespace): prints
{mix: token ids}.

ip netns exec NS python -m tests.multihost.vllm_client ROUTER_ADDRESS MIX [MIX ...]
"""

from __future__ import annotations

import asyncio
import json
import sys

from libs.client.generate import generate, open_channel
from tests.support.vllm_stack import mixes, request


async def main(address: str, names: list[str]) -> dict[str, list[int]]:
    by_name = {mix.name: mix for mix in mixes("qwen2_5_omni")}
    async with open_channel(address) as channel:
        results = await asyncio.gather(
            *(
                generate(channel, request(by_name[n], request_id=f"multihost-vllm-{n}"), timeout_s=180)  # type: ignore[arg-type]
                for n in names
            )
        )
    return {name: result.token_ids for name, result in zip(names, results, strict=True)}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2:]))))
