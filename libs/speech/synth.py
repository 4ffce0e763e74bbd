"""Speech the project makes itself, with espeak-ng (a Debian package the Makefile installs): the
Whisper demo's sample and the test utterances. Deterministic for a given espeak-ng version."""

from __future__ import annotations

import shutil
import subprocess

MAX_TEXT_CHARS = 4000  # about 4-5 minutes of speech at espeak's default rate


class SynthesisError(RuntimeError):
    pass


def speak(text: str, *, words_per_minute: int = 160, voice: str = "en-us", timeout_s: float = 60.0) -> bytes:
    """A mono 16-bit WAV (22.05 kHz, espeak-ng's rate) of `text` read aloud."""
    if not text.strip() or len(text) > MAX_TEXT_CHARS:
        raise SynthesisError(f"text must be 1..{MAX_TEXT_CHARS} characters")
    binary = shutil.which("espeak-ng")
    if binary is None:
        raise SynthesisError("espeak-ng is not installed (make deps installs it: apt-get install espeak-ng)")
    # --stdout writes the WAV; the text goes in on stdin, so it is never parsed as options.
    done = subprocess.run(
        [binary, "--stdout", "-v", voice, "-s", str(words_per_minute)],
        input=text.encode(),
        capture_output=True,
        timeout=timeout_s,
        check=False,
    )
    if done.returncode != 0 or not done.stdout.startswith(b"RIFF"):
        raise SynthesisError(f"espeak-ng failed ({done.returncode}): {done.stderr.decode(errors='replace')[:200]}")
    return fix_wav_sizes(done.stdout)


def fix_wav_sizes(wav: bytes) -> bytes:
    """espeak-ng streaming to stdout cannot seek back: its RIFF and data sizes are placeholders
    (0xFFFFFFFF). Write the real ones so every WAV reader accepts the file."""
    import struct

    data_at = wav.find(b"data", 12)
    if data_at < 0:
        raise SynthesisError("espeak-ng wrote no data chunk")
    out = bytearray(wav)
    struct.pack_into("<I", out, 4, len(wav) - 8)
    struct.pack_into("<I", out, data_at + 4, len(wav) - data_at - 8)
    return bytes(out)
