"""Decode one image safely."""

from __future__ import annotations

import io
import warnings

from PIL import Image, UnidentifiedImageError

from libs.engine.errors import InvalidMediaError, MediaLimitError
from libs.engine.media.limits import MediaLimits


def decode_image(data: bytes, limits: MediaLimits) -> Image.Image:
    if len(data) > limits.max_media_bytes:
        raise MediaLimitError(f"image is {len(data)} bytes, limit {limits.max_media_bytes}", field="media.data")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            # The header is parsed; check the declared size before any pixel is decoded.
            width, height = image.size
            if width * height > limits.max_source_pixels:
                raise MediaLimitError(
                    f"image is {width}x{height} pixels, limit {limits.max_source_pixels}", field="media.data"
                )
            image.load()
            return image.convert("RGB")
    except MediaLimitError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise MediaLimitError(f"image too large: {exc}", field="media.data") from exc
    except UnidentifiedImageError as exc:
        raise InvalidMediaError("not an image in a format this server decodes", field="media.data") from exc
    except Exception as exc:  # Pillow raises many types for corrupt input
        raise InvalidMediaError(f"cannot decode image: {exc}", field="media.data") from exc
