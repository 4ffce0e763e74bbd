"""A minimal proxy in front of vLLM's own disaggregated servers, for `make bench-vs-vllm`.

vLLM ships its EPD proxy as an example (examples/online_serving/disaggregated_encoder/
disagg_epd_proxy.py), not in the wheel; this one does what that example does for one encoder, at
most one prefill and one PD (or decode) server, written for this harness:

1. a chat request with media (`image_url`, `audio_url`, `input_audio` parts) goes first to the
   encoder server whole, with `max_tokens` (and `max_completion_tokens`, when set) 1, not streamed,
   `stream_options` removed; the encoder (`--mm-encoder-only`, EC producer) writes the embeddings to
   the EC connector's shared storage; its answer is discarded, a failure fails the request;
2. with a prefill server (E/P/D): the request again, `max_tokens` 1, not streamed, with
   `kv_transfer_params = {"do_remote_decode": true, ...}`; the `kv_transfer_params` of its answer
   are put into the request for decode (vLLM's NixlConnector handshake);
3. the (possibly amended) original request goes to the PD (or decode) server, and its answer,
   streamed or not, is relayed unchanged.

The example also retries failed stages (3 tries) and fans one request out per item to several
encoders; neither is done here: a failed stage is a failed request, which the benchmark counts.
Given several PD (or decode) servers (`--decode URL,URL`), each request goes to one picked at
random, as the example picks (`random.choice`; seeded here, `--seed`): it knows nothing of a
conversation's prefix. `GET /proxy/calls` lists, per request so far, its `x-request-id`, whether
the encoder was called and which PD (or decode) server took it (`make bench-conversations`).

    python -m tests.benchmarks.peers.vllm_proxy --port P --encoder URL [--prefill URL] --decode URL[,URL...]
"""

from __future__ import annotations

import argparse
import copy
import random
import uuid
from collections import deque
from typing import Any

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

MEDIA_PARTS = frozenset({"image_url", "audio_url", "input_audio"})
# The remote-decode marker the example sends its prefill server (NixlConnector's request side).
CALLS_KEPT = 100_000  # per-request records `GET /proxy/calls` lists, the latest kept
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def has_media(body: dict[str, Any]) -> bool:
    """Whether a chat request carries a media part (only those go to the encoder)."""
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in MEDIA_PARTS for p in content):
            return True
    return False


def one_token(body: dict[str, Any]) -> dict[str, Any]:
    """A copy of the request asking for one token, answered whole (the encoder's and prefill's)."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    return out


def encoder_request(body: dict[str, Any]) -> dict[str, Any]:
    return one_token(body)


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    out = one_token(body)
    out["kv_transfer_params"] = dict(REMOTE_DECODE)
    return out


def decode_request(body: dict[str, Any], prefill_answer: dict[str, Any] | None) -> dict[str, Any]:
    """The original request, with the prefill answer's `kv_transfer_params` when it has any."""
    out = copy.deepcopy(body)
    params = (prefill_answer or {}).get("kv_transfer_params")
    if params:
        out["kv_transfer_params"] = params
    return out


class Proxy:
    def __init__(self, encoder: str, prefill: str | None, decode: str, timeout_s: float, seed: int = 0) -> None:
        self.encoder, self.prefill = encoder.rstrip("/"), (prefill or "").rstrip("/")
        # One or several PD (decode) servers, comma-separated; one is picked at random per request.
        self.decodes = [u.rstrip("/") for u in decode.split(",") if u]
        self.decode = self.decodes[0]
        self.timeout = ClientTimeout(total=timeout_s)
        self.session: ClientSession | None = None
        self._random = random.Random(seed)
        self.calls: deque[dict[str, Any]] = deque(maxlen=CALLS_KEPT)

    async def start(self, _app: web.Application) -> None:
        # One pooled session, unlimited connections (as the example): the client bounds concurrency.
        self.session = ClientSession(timeout=self.timeout, connector=TCPConnector(limit=0))

    async def close(self, _app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def _post_whole(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        assert self.session is not None
        async with self.session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                raise web.HTTPBadGateway(text=f"{url}: {resp.status} {(await resp.text())[:300]}")
            answer: dict[str, Any] = await resp.json()
            return answer

    async def chat(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        try:
            body = await request.json()
        except ValueError:
            raise web.HTTPBadRequest(text="body: not JSON") from None
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text="body: not a JSON object")
        headers = {"x-request-id": request.headers.get("x-request-id", uuid.uuid4().hex)}
        path = "/v1/chat/completions"
        decode = self.decodes[0] if len(self.decodes) == 1 else self._random.choice(self.decodes)
        media = has_media(body)
        self.calls.append({"request_id": headers["x-request-id"], "encoder": media, "decode": decode})
        if media:
            await self._post_whole(self.encoder + path, encoder_request(body), headers)
        answer = await self._post_whole(self.prefill + path, prefill_request(body), headers) if self.prefill else None
        async with self.session.post(decode + path, json=decode_request(body, answer), headers=headers) as resp:
            out = web.StreamResponse(status=resp.status, headers={"Content-Type": resp.content_type})
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def models(self, _request: web.Request) -> web.Response:
        assert self.session is not None
        async with self.session.get(self.decode + "/v1/models") as resp:
            return web.Response(status=resp.status, body=await resp.read(), content_type="application/json")

    async def calls_made(self, _request: web.Request) -> web.Response:
        return web.json_response(list(self.calls))


def app(proxy: Proxy) -> web.Application:
    application = web.Application(client_max_size=64 << 20)  # several images per request, base64
    application.router.add_post("/v1/chat/completions", proxy.chat)
    application.router.add_get("/v1/models", proxy.models)
    application.router.add_get("/proxy/calls", proxy.calls_made)
    application.on_startup.append(proxy.start)
    application.on_cleanup.append(proxy.close)
    return application


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--encoder", required=True, help="base URL of the encoder-only vllm serve")
    parser.add_argument("--prefill", default="", help="base URL of the prefill vllm serve (E/P/D)")
    parser.add_argument(
        "--decode", required=True, help="base URL of the PD (or decode) vllm serve; several, comma-separated"
    )
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per upstream call")
    parser.add_argument("--seed", type=int, default=0, help="of the random pick among several --decode servers")
    ns = parser.parse_args(argv)
    proxy = Proxy(ns.encoder, ns.prefill or None, ns.decode, ns.timeout_s, ns.seed)
    web.run_app(app(proxy), host=ns.host, port=ns.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
