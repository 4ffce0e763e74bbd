"""Running the encoder tower on the engine thread, traced as preprocess + encode stages."""

from __future__ import annotations

import time

from libs.runtime import types as eng
from libs.runtime.encoder_runner import EncoderRunner
from libs.serving.compute_thread import ComputeThread
from libs.serving.convert import engine_errors
from libs.telemetry.stages import record_stage


async def encode_items(
    thread: ComputeThread, runner: EncoderRunner, media: list[eng.MediaInput], field_prefix: str = ""
) -> list[eng.EncodedItem]:
    """Encode on the compute thread; engine errors become contract errors. The wait for the engine
    thread (behind other encodes) is a queue stage of its own, apart from the service's bookkeeping."""
    timings: dict[str, int] = {}
    queued_ns = time.time_ns()
    with engine_errors(field_prefix):
        encoded = await thread.run(runner.encode, media, timings)
    record_stage("encoder.engine_wait", "queue", queued_ns, timings["start"])
    record_stage("encoder.preprocess", "preprocess", timings["start"], timings["preprocessed"], items=len(media))
    record_stage("encoder.compute", "encode", timings["preprocessed"], timings["end"], items=len(media))
    return encoded
