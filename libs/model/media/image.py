"""Decode one image safely, to the RGB pixels the reference processors see.

Reference: transformers `image_utils.load_image` (open, `ImageOps.exif_transpose`) followed by the
image processor's own RGB conversion, transformers 5.23 `image_transforms.convert_to_rgb`: an image
with an alpha band or a palette transparency is composited onto white, anything else (grayscale,
palette, CMYK, 16-bit) goes through Pillow's `convert("RGB")`. Compositing on white is also what
qwen-vl-utils (`to_rgb`) and vLLM do; `load_image`'s own `convert("RGB")` would drop the alpha band
instead (docs/runtime.md, "Preprocessing").
"""

from __future__ import annotations

import io
import re
import warnings

from PIL import Image, ImageOps, UnidentifiedImageError

from libs.model.errors import InvalidMediaError, MediaLimitError
from libs.model.media.limits import MediaLimits


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers 5.23 `convert_to_rgb` for a PIL image (alpha composited onto white)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _too_large(size: str, limits: MediaLimits) -> str:
    return f"image is {size} pixels, limit {limits.max_source_pixels} (refused from its header, before decoding)"


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
                raise MediaLimitError(_too_large(f"{width}x{height}", limits), field="media.data")
            image.load()
            upright = ImageOps.exif_transpose(image)  # EXIF orientation, as load_image applies it
            return to_rgb(upright)
    except MediaLimitError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # Pillow's own guard (above ~89 Mpixel) fires inside `open`, before our check: same answer.
        declared = re.search(r"\((\d+) pixels\)", str(exc))
        raise MediaLimitError(
            _too_large(declared.group(1) if declared else "over", limits), field="media.data"
        ) from exc
    except UnidentifiedImageError as exc:
        raise InvalidMediaError("not an image in a format this server decodes", field="media.data") from exc
    except Exception as exc:  # Pillow raises many types for corrupt input
        raise InvalidMediaError(f"cannot decode image: {exc}", field="media.data") from exc
