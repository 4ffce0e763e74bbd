"""Running the encoder tower on the engine thread, traced as preprocess + encode stages."""

from __future__ import annotations

from libs.engine import types as eng
from libs.engine.encoder_runner import EncoderRunner
from libs.serving.convert import engine_errors
from libs.serving.engine_loop import EngineThread
from libs.telemetry.stages import record_stage


async def encode_items(
    engine: EngineThread, runner: EncoderRunner, media: list[eng.MediaInput], field_prefix: str = ""
) -> list[eng.EncodedItem]:
    """Encode on the engine thread; engine errors become contract errors."""
    timings: dict[str, int] = {}
    with engine_errors(field_prefix):
        encoded = await engine.run(runner.encode, media, timings)
    record_stage("encoder.preprocess", "preprocess", timings["start"], timings["preprocessed"], items=len(media))
    record_stage("encoder.compute", "encode", timings["preprocessed"], timings["end"], items=len(media))
    return encoded
