"""The encoder on vLLM (the E role, `--engine vllm`): vLLM runs the checkpoint's vision tower
encoder-only (`mm_encoder_only`), batching concurrent Encode calls in its own scheduler (up to
`--encode-batch-items` calls a step), and its worker writes every output into this service's registered
pool (`ec_producer.py`), where prefill READs it over NIXL as from the reference encoder: same
`EncodeResponse`, layouts, specs, leases, stamps and checksums.

Per `Encode` call (vLLM batches the items of concurrent calls in one tower step):
1. resolve its bytes and compute its layout with the project's preprocessing (the contract's
   layout metadata; vLLM's output must match it row for row);
2. reserve its slot in the shared pool (rows x width x dtype known from the layout) and clear the
   slot's stamp area;
3. submit one encoder-only request to vLLM for the whole call (the items' pixels resized by the
   project, so the request's processor options hold and vLLM's grid is the layout's; one
   placeholder per item, in item order; a uuid unique per item; the slots, in item order, in
   `ec_transfer_params`) and wait for vLLM to finish it. A call of images only goes in rendered,
   its patch rows cut by the project (encoder_inputs.py: vLLM's input processing does not run); a
   call with a video goes through vLLM's processor. One request per call, not per item: vLLM's
   per-request work (processing, scheduling, output) is paid once;
4. check each item's `written` mark (or, without it, the worker's failure report: FAILED_PRECONDITION
   naming the item when vLLM's rows or width differ from the layout), then publish the slots
   (lease, stamp, checksums) - or, for an INLINE-only caller, copy the bytes into the handles and
   free them.
If anything fails, every slot of the call is given back; a slot whose request may still be
written by the worker (a cancel, an engine failure) is quarantined first (pool.py), not reused.

Families: Qwen2.5-VL and Qwen3-VL (image, video). Qwen2.5-Omni's tower crashes vLLM's CPU worker
(/work/shared/vllm.md) and is refused at start-up; Whisper is refused on vLLM for every role.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import tempfile
import time
import uuid as uuids
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import structlog
import torch

from libs.backends.api import EncoderBackend
from libs.backends.engines import capability, encoder_refusal
from libs.backends.in_flight import InFlight
from libs.backends.settings import EncoderBackendSettings
from libs.backends.vllm import runtime
from libs.backends.vllm.ec_producer import failure_file, written_mark
from libs.backends.vllm.encoder_inputs import (
    IMAGE_PAD,
    VISION_END,
    VISION_START,
    ImageTokens,
    RenderedImage,
    rendered_images,
)
from libs.backends.vllm.shared_pool import SlotDescriptor
from libs.backends.vllm.supervisor import EngineLife, EngineSupervisor, start_or_exit
from libs.contract.epd.v1 import encoder_pb2, layout_pb2, tensor_pb2
from libs.contract.errors import EpdError, FailedPrecondition, NotFound, error_for
from libs.contract.validation import Limits
from libs.model import types as eng
from libs.model.checkpoint import Checkpoint
from libs.model.content import media_hash
from libs.model.errors import UnsupportedModalityError
from libs.model.families import adapter_for
from libs.model.families.qwen_vl import QwenVLAdapter
from libs.model.media.limits import MediaLimits
from libs.serving import convert
from libs.serving.convert import engine_errors
from libs.serving.media_source import job_media
from libs.serving.service_info import model_identity
from libs.serving.transport import Transport, transfer_config
from libs.telemetry.stages import stage
from libs.transfer.producer import Reservation
from libs.transfer.stamp import STAMP_BYTES

_log = structlog.get_logger(__name__)
# How long a slot whose vLLM request did not finish cleanly stays out of the pool: the worker may
# still write it in the step it was running (seconds; a step of the tiny towers takes well under 1).
QUARANTINE_S = 30.0


# One item's prompt per modality: vLLM expands the placeholder to the item's rows from the media.
_PROMPTS = {
    eng.Modality.IMAGE: VISION_START + IMAGE_PAD + VISION_END,
    eng.Modality.VIDEO: VISION_START + "<|video_pad|>" + VISION_END,
}


def _internal(message: str) -> EpdError:
    return error_for(grpc.StatusCode.INTERNAL, message)


@dataclasses.dataclass
class _Item:
    layout: eng.ItemLayout
    # What vLLM takes: an image's patch rows (a rendered call), or what its processor takes:
    # [H, W, 3] uint8, or ([T, H, W, 3] uint8 frames, metadata).
    media: Any
    reservation: Reservation
    uuid: str


def advertised_specs(adapter: Any, dtype: torch.dtype) -> list[eng.EmbeddingSpec]:
    """What vLLM's tower gives per modality (the LM's hidden width; Qwen3-VL's deepstack features
    too), in the engine's dtype: the embedding contract the router checks against the LM service's
    at first contact (`check_embedding_specs`), so any encoder x LM engine pair whose width, dtype
    and extras match is allowed and any other refused (FAILED_PRECONDITION)."""
    width = adapter.hidden_size
    name = str(dtype).removeprefix("torch.")
    return [
        eng.EmbeddingSpec(
            modality,
            width,
            name,
            tuple(eng.ExtraTensorSpec(n, width, name) for n in adapter.embedding_extra_names(modality)),
        )
        for modality in sorted(adapter.modalities, key=lambda m: m.value)
        if modality in _PROMPTS
    ]


class VllmEncoder(EncoderBackend):
    """`EncoderBackend` on vLLM's AsyncLLM (encoder-only)."""

    name = "vllm"
    transport: Transport

    def __init__(self, settings: EncoderBackendSettings, transport: Transport, failure_dir: Path) -> None:
        self.checkpoint = Checkpoint(settings.model)
        self.adapter = adapter_for(self.checkpoint)
        self.weights_digest = self.checkpoint.weights_digest()
        self.transport = transport
        self.limits = Limits()
        self.media_limits = MediaLimits()
        self.file_root = settings.file_root
        self.max_running = settings.max_running
        self.in_flight = InFlight()
        self._failure_dir = failure_dir
        self._dtype = torch.float32  # the engine's, once it started (`--dtype auto` resolves there)
        # Once it started: whether its tower normalizes uint8 pixels itself, the image prompt tokens.
        self._tower_normalizes = False
        self._image_tokens: ImageTokens | None = None
        # Decoding and resizing, one item at a time on one thread: more threads add no core under
        # the GIL, they only delay the event loop's handling of the next calls (and so their first
        # tokens; docs/results/bench-vs-vllm.md).
        self._preparing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encoder-prepare")
        self._active = 0
        self.supervisor = EngineSupervisor(
            lambda: runtime.build_engine(settings, failure_dir=failure_dir, ec_consumer=False, ec_producer=True),
            EngineLife.of(settings),
            queued=lambda: self._active,
        )

    def embedding_specs(self) -> list[eng.EmbeddingSpec]:
        return advertised_specs(self.adapter, self._dtype)

    def capabilities(self) -> tuple[str, ...]:
        return (capability(self.name),)

    @property
    def active(self) -> int:
        return self._active

    def watch_health(self, setter: Any) -> None:
        self.supervisor.watch_health(setter)

    def watch_fatal(self, fail: Any) -> None:
        self.supervisor.watch_fatal(fail)

    async def encode(self, request: encoder_pb2.EncodeRequest, deadline: float | None) -> encoder_pb2.EncodeResponse:
        with self.in_flight.track(request.request_id):
            return await self._encode(request, deadline)

    async def _encode(self, request: encoder_pb2.EncodeRequest, deadline: float | None) -> encoder_pb2.EncodeResponse:
        if request.cache_policy == encoder_pb2.CACHE_POLICY_CACHED_ONLY:
            raise NotFound("items: this encoder keeps no cache (vLLM engine)")
        producer = self.transport.producer
        assert producer is not None, "the transport is bound once the server listens"
        media = job_media(request, max_bytes=self.limits.max_inline_media_bytes, file_root=self.file_root)
        loop = asyncio.get_running_loop()
        rendered = all(m.modality is eng.Modality.IMAGE for m in media)
        with stage("encoder.preprocess", "preprocess", items=len(media)):
            prepared = await asyncio.gather(
                *(loop.run_in_executor(self._preparing, self._prepare, m, i, rendered) for i, m in enumerate(media))
            )
        items: list[_Item] = []
        published: list[tensor_pb2.TensorHandle] = []
        clean = True  # vLLM's request for this call cannot write a slot any more (not submitted, or finished)
        try:
            for i, (layout, vllm_media) in enumerate(prepared):
                items.append(self._reserve(producer, request.request_id, i, layout, vllm_media))
            self._active += 1
            clean = False
            try:
                with stage("encoder.compute", "encode", **{"epd.engine": "vllm"}):
                    await self._run(request.request_id, items, deadline, rendered)
            finally:
                self._active -= 1
            clean = True
            for i, item in enumerate(items):
                self._check_written(i, item)
            nixl = tensor_pb2.TRANSPORT_KIND_NIXL in request.accepted_transports
            response = encoder_pb2.EncodeResponse()
            with stage("encoder.publish", "transfer"):
                for item in items:
                    if nixl:
                        handle = item.reservation.publish()
                        published.append(handle)
                    else:
                        handle = producer.put_inline(dict(item.reservation.tensors))
                        item.reservation.abort()
                    layout_wire = convert.item_layout_to_wire(item.layout)
                    response.items.append(layout_pb2.EncodedMedia(layout=layout_wire, embeddings=handle))
            return response
        except BaseException:
            producer.release(h.lease_id for h in published)
            for item in items:
                self._give_back(item, clean)
                # The worker reports an item it could not write (and marks every one it wrote).
                failure_file(self._failure_dir, item.uuid).unlink(missing_ok=True)
            raise

    def _prepare(self, media: eng.MediaInput, position: int, rendered: bool) -> tuple[eng.ItemLayout, Any]:
        """The item's layout (the project's preprocessing) and its media as vLLM takes it: an
        image's patch rows in a `rendered` call, else what vLLM's processor takes."""
        with engine_errors(f"items[{position}]"):
            if media.modality not in self.adapter.modalities or media.modality not in _PROMPTS:
                raise UnsupportedModalityError(
                    f"the vLLM encoder has no {media.modality.value} encoder for this model", field="media.modality"
                )
            # The project's layout from the same pixels vLLM is given (each item decoded once here).
            adapter = self.adapter
            assert isinstance(adapter, QwenVLAdapter), "start() refuses the other families"
            vision = adapter.vision
            if media.modality is eng.Modality.IMAGE:
                # Resized as the project does (the request's pixel bounds included): vLLM's processor
                # takes it as it is (`do_resize=False`), so its grid is the layout's.
                resized = vision.resized_image(media.data, media.options, self.media_limits)
                layout = adapter.image_item(media, media_hash(media), vision.image_grid(resized))
                if not rendered:
                    return layout, resized[0].permute(1, 2, 0).contiguous().numpy()  # [H, W, 3] uint8
                if self._tower_normalizes:
                    return layout, vision.image_patches(resized, normalized=False)  # uint8
                # Normalized here, in the engine's dtype, as vLLM's processor would give them.
                return layout, vision.image_patches(resized).to(self._dtype)
            clip = vision.video(media.data, media.options, self.media_limits)
            layout = adapter.video_item(media, media_hash(media), clip)
            decoded = clip.decoded
            frames = decoded.frames.permute(0, 2, 3, 1).contiguous().numpy()  # [T, H, W, 3] uint8
            # The project sampled and resized the frames: vLLM takes them as they are, with the
            # source's metadata (its sampled fps is the project's).
            metadata = {
                "fps": float(decoded.source.fps),
                "duration": decoded.source.total_frames / decoded.source.fps,
                "total_num_frames": int(decoded.source.total_frames),
                "frames_indices": [int(i) for i in decoded.indices],
                "video_backend": "pyav",
                "do_sample_frames": False,
            }
            return layout, (frames, metadata)

    def _reserve(self, producer: Any, request_id: str, position: int, layout: eng.ItemLayout, vllm_media: Any) -> _Item:
        names = ("embeddings", *self.adapter.embedding_extra_names(layout.modality))
        width = self.adapter.hidden_size
        reservation = producer.reserve({name: ((layout.rows, width), self._dtype) for name in names})
        # A mark left by an earlier lease of these bytes must not pass for this item's.
        start = reservation.slot.offset
        self.transport.agent.pool.buffer[start : start + STAMP_BYTES] = bytes(STAMP_BYTES)
        return _Item(layout, vllm_media, reservation, f"epd-enc-{uuids.uuid4().hex}")

    async def _run(self, request_id: str, items: list[_Item], deadline: float | None, rendered: bool) -> None:
        """One encoder-only vLLM request for the call's items, run to its end."""
        pool_path = self.transport.agent.pool.share_path
        assert pool_path is not None, "the vLLM encoder's pool is shared"
        width = self.adapter.hidden_size
        slots = [
            SlotDescriptor(
                key=item.uuid,
                request_id=request_id,
                item=position,
                pool_path=pool_path,
                slot_offset=item.reservation.slot.offset,
                rows=item.layout.rows,
                dtype=str(self._dtype).removeprefix("torch."),
                tensors=tuple((name, offset, width) for name, offset in item.reservation.placement()),
            ).to_dict()
            for position, item in enumerate(items)
        ]
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, extra_args={"ec_transfer_params": {"epd_slots": slots}})
        # vLLM orders a request's items by their placeholders' positions: the prompt lists them in
        # item order, so the worker's n-th item is the n-th slot (ec_producer.py).
        engine = self.supervisor.engine()
        prompt = self._rendered(engine.llm, items) if rendered else self._for_processor(items)
        stream = engine.llm.generate(prompt, params, f"{request_id}-{items[0].uuid[-8:]}")
        try:
            while True:
                out = await engine.next(stream, deadline)
                if out.finished:
                    return
        except EpdError:
            raise
        except Exception as exc:
            raise runtime.engine_error(exc) from exc

    def _rendered(self, llm: Any, items: list[_Item]) -> Any:
        """The images' request as vLLM's renderer would make it (encoder_inputs.py)."""
        assert self._image_tokens is not None, "set once the engine started"
        images = []
        for item in items:
            assert item.layout.image is not None, "a rendered call holds images only"
            images.append(RenderedImage(item.media, item.layout.image, item.layout.placeholder_token_count, item.uuid))
        return rendered_images(llm.renderer.get_mm_processor(), self._image_tokens, images)

    def _for_processor(self, items: list[_Item]) -> dict[str, Any]:
        """The items' request as vLLM's input processing takes it (a call with a video)."""
        data: dict[str, list[Any]] = {}
        uuids: dict[str, list[str]] = {}
        for item in items:
            kind = item.layout.modality.value
            data.setdefault(kind, []).append(item.media)
            uuids.setdefault(kind, []).append(item.uuid)
        return {
            "prompt": "".join(_PROMPTS[item.layout.modality] for item in items),
            "multi_modal_data": data,
            "multi_modal_uuids": uuids,
            # The pixels are the project's, already resized to the patch grid: vLLM's processor
            # would size them again with its own pixel bounds (a different grid for a video, and
            # for any item with the request's processor options).
            "mm_processor_kwargs": {"do_resize": False},
        }

    def _check_written(self, position: int, item: _Item) -> None:
        """The worker left the item's mark, or its report of why not (raised as its status)."""
        start = item.reservation.slot.offset
        mark = written_mark(item.uuid)
        if bytes(self.transport.agent.pool.buffer[start : start + len(mark)]) == mark:
            return
        failure = failure_file(self._failure_dir, item.uuid)
        if failure.is_file():
            import json

            report = json.loads(failure.read_text())
            code, message = str(report.get("code", "INTERNAL")), str(report.get("message", ""))
            if code == "FAILED_PRECONDITION":
                raise FailedPrecondition(message)
            raise _internal(message or f"items[{position}]: vLLM's worker failed to write the item")
        raise _internal(f"items[{position}]: vLLM finished the request without writing the item's embeddings")

    def _give_back(self, item: _Item, clean: bool) -> None:
        """Return an unpublished slot: at once when vLLM is done with it, after a quarantine when
        its request may still be written (cancelled, engine failure)."""
        reservation = item.reservation
        if clean:
            reservation.abort()
            return
        pool = self.transport.agent.pool
        try:
            reservation.detach()
        except RuntimeError:
            return  # published: the lease (released above) gave it back
        pool.quarantine(reservation.slot)
        loop = asyncio.get_running_loop()
        loop.call_later(QUARANTINE_S, pool.release_quarantined, reservation.slot)

    async def close(self) -> None:
        self._preparing.shutdown(wait=False, cancel_futures=True)
        await self.supervisor.close()
        self.transport.close()
        shutil.rmtree(self._failure_dir, ignore_errors=True)


async def start(settings: EncoderBackendSettings) -> VllmEncoder:
    """Start vLLM encoder-only, writing into this service's shared pool."""
    if (why := encoder_refusal(settings.model)) is not None:
        raise SystemExit(f"epd: {why}")
    torch.set_num_threads(settings.torch_threads)
    checkpoint = Checkpoint(settings.model)
    identity = model_identity(settings, checkpoint.weights_digest())
    config = dataclasses.replace(transfer_config(settings, "encoder"), shared_pool=True, huge_pages=False)
    transport = Transport(config, identity, produce=True, consume=False)
    failure_dir = Path(tempfile.mkdtemp(prefix="epd-vllm-encoder-"))
    backend = VllmEncoder(settings, transport, failure_dir)
    started = time.monotonic()
    await asyncio.to_thread(runtime.import_vllm, settings)
    await start_or_exit(backend.supervisor, backend.close)
    llm = backend.supervisor.current()
    backend._dtype = getattr(torch, runtime.engine_dtype(llm))
    backend._tower_normalizes = bool(llm.vllm_config.model_config.multimodal_config.mm_device_do_normalize)
    backend._image_tokens = ImageTokens.of(llm.renderer.get_tokenizer())
    _log.info("vLLM encoder started", seconds=round(time.monotonic() - started, 1))
    return backend
