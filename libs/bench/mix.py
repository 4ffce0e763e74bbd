"""Request mixes: a small spec ("text=0.5,image=0.5,images=4,max_tokens=16") -> sampled request kinds
-> `GenerateRequest`s with synthetic media, distinct per request (no encoder-cache hits unless asked).

Spec keys: the shares `text`, `image`, `video`, `audio` (weights, normalised to 1); `images` per
image request; `max_tokens`; `image_w`/`image_h` (pixels); `video_frames`; `audio_s` (seconds);
`repeat` (0..1: share of media items reused from earlier requests, to exercise caches).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

from libs.contract.epd.v1 import generate_pb2, media_pb2, sampling_pb2

KINDS = ("text", "image", "video", "audio")
_PROMPTS = {
    "text": "Write a short story about a lighthouse keeper and a storm.",
    "image": "Describe what you see in these pictures.",
    "video": "Describe what happens in this clip.",
    "audio": "What do you hear in this recording?",
}


@dataclass(frozen=True)
class MixSpec:
    # Shares: the kinds not named get none; with none named, every request is an image request.
    text: float = 0.0
    image: float = 0.0
    video: float = 0.0
    audio: float = 0.0
    images: int = 1
    max_tokens: int = 16
    image_w: int = 448
    image_h: int = 336
    video_frames: int = 16
    audio_s: float = 10.0
    repeat: float = 0.0

    def __post_init__(self) -> None:
        shares = [getattr(self, k) for k in KINDS]
        if any(s < 0 for s in shares):
            raise ValueError("mix shares must be >= 0")
        if not any(shares):
            object.__setattr__(self, "image", 1.0)  # sizes only: the default image mix
        if self.images < 1 or self.max_tokens < 1 or not 0 <= self.repeat <= 1:
            raise ValueError("images and max_tokens must be >= 1 and repeat in [0, 1]")

    @classmethod
    def parse(cls, text: str) -> MixSpec:
        """`key=value` pairs separated by commas; unknown keys are an error."""
        types = {f.name: f.type for f in fields(cls)}
        values: dict[str, float] = {}
        for pair in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = pair.partition("=")
            if not sep or key.strip() not in types:
                raise ValueError(f"bad mix entry {pair!r}; keys: {', '.join(types)}")
            key = key.strip()
            values[key] = int(raw) if types[key] in ("int", int) else float(raw)
        if any(k in values for k in KINDS) and sum(values.get(k, 0.0) for k in KINDS) <= 0:
            raise ValueError("mix shares must have a positive sum")
        return cls(**values)  # type: ignore[arg-type]

    def shares(self) -> dict[str, float]:
        total = sum(getattr(self, k) for k in KINDS)
        return {k: getattr(self, k) / total for k in KINDS}

    def describe(self) -> str:
        parts = [f"{k}={v:g}" for k, v in self.shares().items() if v > 0]
        return ",".join([*parts, f"images={self.images}", f"max_tokens={self.max_tokens}"])


def sample_kind(spec: MixSpec, rng: random.Random) -> str:
    """One request kind, drawn with the spec's shares."""
    u = rng.random()
    acc = 0.0
    shares = spec.shares()
    for kind in KINDS:
        acc += shares[kind]
        if u < acc:
            return kind
    return next(k for k in reversed(KINDS) if shares[k] > 0)


@dataclass
class PlannedRequest:
    kind: str
    request: generate_pb2.GenerateRequest


class MediaFactory:
    """Synthetic media by seed (imports the codecs lazily; memoised when the mix repeats items)."""

    def __init__(self, spec: MixSpec) -> None:
        self.spec = spec
        self._made: dict[tuple[str, int], bytes] = {}

    def make(self, kind: str, seed: int) -> media_pb2.MediaItem:
        from libs.model.media import synthetic  # PyAV, Pillow: only when media are built

        key = (kind, seed)
        data = self._made.get(key)
        if data is None:
            s = self.spec
            if kind == "image":
                data = synthetic.png_bytes(s.image_w, s.image_h, seed=seed)
            elif kind == "video":
                data = synthetic.video_bytes(224, 168, frames=s.video_frames, fps=4, seed=seed)
            else:
                data = synthetic.wav_bytes(s.audio_s, seed=seed)
            if s.repeat > 0:  # kept only when a later request may reuse it (an endless run's memory)
                self._made[key] = data
        modality = {"image": media_pb2.MODALITY_IMAGE, "video": media_pb2.MODALITY_VIDEO}.get(
            kind, media_pb2.MODALITY_AUDIO
        )
        return media_pb2.MediaItem(modality=modality, data=data)


def plan_requests(
    spec: MixSpec,
    count: int,
    *,
    seed: int = 0,
    first_seed: int = 1,
    on_progress: Callable[[int], None] | None = None,
) -> list[PlannedRequest]:
    """`count` requests drawn from the mix; media seeds start at `first_seed` and never repeat
    unless `spec.repeat` asks (then a share of items reuses an earlier item's seed).
    `on_progress(n)` hears of each request built (media take a while: a user wants to see them come)."""
    out = []
    for planned in itertools.islice(iter_requests(spec, seed=seed, first_seed=first_seed), count):
        out.append(planned)
        if on_progress is not None:
            on_progress(len(out))
    return out


def iter_requests(spec: MixSpec, *, seed: int = 0, first_seed: int = 1) -> Iterator[PlannedRequest]:
    """The requests of `plan_requests`, one at a time and without end (the same ones, in order)."""
    from libs.client.generate import build_request  # grpc channel helpers: not needed to sample

    rng = random.Random(seed)
    factory = MediaFactory(spec)
    used: list[int] = []
    next_seed = first_seed
    for i in itertools.count():
        kind = sample_kind(spec, rng)
        media = []
        for _ in range(spec.images if kind == "image" else 0 if kind == "text" else 1):
            if used and rng.random() < spec.repeat:
                item_seed = rng.choice(used)
            else:
                item_seed, next_seed = next_seed, next_seed + 1
                used.append(item_seed)
            media.append(factory.make(kind, item_seed))
        sampling = sampling_pb2.SamplingParams(max_tokens=spec.max_tokens, temperature=0.0)
        request = build_request(_PROMPTS[kind], media, sampling=sampling, request_id=f"bench-{seed}-{i}")
        yield PlannedRequest(kind, request)
