"""vLLM's own unsplit run of a checkpoint: one `vllm.LLM` in a child process, given the raw media of
each mix (vLLM preprocesses and encodes them itself), greedy, float32. What EPD on vLLM is
compared with where vLLM's preprocessing agrees with the project's (docs/vllm.md, "Known
differences"): text, images and audio; not video, which vLLM samples and sizes its own way.
Whisper: the one-window clips of the speech corpus (at 16 kHz, as generate() gets them) from the
English-only decoder prompt generate() uses (`WHISPER_CLIPS`; vLLM's transcription API would add
language and task tokens).

    .venv/bin/python -m tests.support.vllm_unsplit MODEL FAMILY   # one JSON line: mix -> tokens
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import wave
from pathlib import Path
from typing import Any

from tests.support.vllm_stack import PROMPT, TOKENS, mixes

ROOT = Path(__file__).resolve().parents[2]
_KIND = {1: "image", 2: "video", 3: "audio"}  # media_pb2.Modality values
# Mixes whose preprocessing vLLM shares with the project (the rest differ by vLLM's video sampling).
AGREEING_MIXES = frozenset({"text", "image", "two_images", "audio"})
_MARK = "@@unsplit "


def _decoded(modality: int, data: bytes) -> Any:
    """The media as vLLM's offline API takes them (what the project's encoder decodes)."""
    import numpy as np

    if modality == 1:
        from PIL import Image

        return Image.open(io.BytesIO(data)).convert("RGB")
    if modality == 3:
        with wave.open(io.BytesIO(data)) as w:
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)
            return pcm.astype(np.float32) / 32768.0, w.getframerate()
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate or 1)
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
    meta = {"fps": fps, "duration": len(frames) / fps, "total_num_frames": len(frames),
            "frames_indices": list(range(len(frames))), "video_backend": "pyav", "do_sample_frames": True}  # fmt: skip
    return frames, meta


WHISPER_CLIPS = ("short", "twenty_seconds")


def _run_whisper(model: str) -> dict[str, list[int] | str]:
    """Each clip's tokens (end-of-text dropped, as generate() returns them) from vLLM's Whisper,
    its own feature extraction and tower."""
    from vllm import LLM, SamplingParams

    from tests.support.hf_reference import reference_audio
    from tests.support.speech_corpus import UTTERANCES, utterance

    llm = LLM(model=model, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20,
              max_model_len=448, max_num_seqs=8, seed=0)  # fmt: skip
    tokenizer = llm.get_tokenizer()
    english_only = [tokenizer.convert_tokens_to_ids(t) for t in ("<|startoftranscript|>", "<|notimestamps|>")]
    out: dict[str, list[int] | str] = {}
    for name in WHISPER_CLIPS:
        # At 16 kHz as generate() is fed it (vLLM's own resampler needs an extra not installed here).
        audio = (reference_audio(utterance(*UTTERANCES[name]), "wav", 16000), 16000)
        prompt = {
            "encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": audio}},
            "decoder_prompt": {"prompt_token_ids": english_only},
        }
        result = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=200), use_tqdm=False)[0]
        tokens = list(result.outputs[0].token_ids)
        out[name] = tokens[:-1] if tokens[-1:] == [tokenizer.eos_token_id] else tokens
    return out


def _run(model: str, family: str) -> dict[str, list[int] | str]:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    if family == "whisper":
        return _run_whisper(model)

    tokenizer = AutoTokenizer.from_pretrained(model)
    llm = LLM(model=model, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20,
              max_model_len=4096, max_num_seqs=8, seed=0)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS)
    out: dict[str, list[int] | str] = {}
    for mix in mixes(family):
        content: list[dict[str, str]] = [{"type": _KIND[m]} for m, _ in mix.media]
        content.append({"type": "text", "text": PROMPT})
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        data: dict[str, list[Any]] = {}
        for m, raw in mix.media:
            data.setdefault(_KIND[m], []).append(_decoded(m, raw))
        prompt: dict[str, Any] = {"prompt": text}
        if data:
            prompt["multi_modal_data"] = {k: v[0] if len(v) == 1 else v for k, v in data.items()}
        if mix.video_fps is not None:
            prompt["mm_processor_kwargs"] = {"fps": mix.video_fps}
        try:
            result = llm.generate([prompt], params, use_tqdm=False)[0]
            out[mix.name] = list(result.outputs[0].token_ids)
        except Exception as exc:  # a mix vLLM cannot preprocess itself is reported, not fatal
            out[mix.name] = f"error: {type(exc).__name__}: {str(exc)[:120]}"
    return out


def unsplit_tokens(model: Path, family: str, timeout_s: float = 600.0) -> dict[str, list[int] | str]:
    """Every mix of `family` through vLLM alone (a child process: vLLM's engine and its threads
    end with it). Raises with the child's stderr tail when it printed no result."""
    child = subprocess.run(
        [sys.executable, "-m", "tests.support.vllm_unsplit", str(model), family],
        capture_output=True, text=True, cwd=ROOT, timeout=timeout_s,
    )  # fmt: skip
    lines = [line for line in child.stdout.splitlines() if line.startswith(_MARK)]
    if not lines:
        raise RuntimeError(f"vLLM unsplit run of {family} failed (exit {child.returncode}): {child.stderr[-2000:]}")
    result: dict[str, list[int] | str] = json.loads(lines[-1][len(_MARK) :])
    return result


if __name__ == "__main__":
    print(_MARK + json.dumps(_run(sys.argv[1], sys.argv[2])), flush=True)
