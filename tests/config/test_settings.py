"""The settings loader: flags beat environment beat defaults; bad values name their source."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import pytest

from libs.config import CommonSettings, SettingsError, load_settings, setting

pytestmark = pytest.mark.unit


@dataclasses.dataclass(frozen=True)
class EncoderLike(CommonSettings):
    max_queue: int = setting(64, "bounded request queue length")
    batch_timeout_s: float = setting(0.005, "batching window, in seconds")
    checksum: bool = setting(False, "checksum transferred tensors")
    peers: tuple[str, ...] = setting((), "peer addresses, comma-separated")
    mode: Literal["a", "b"] = setting("a", "mode")


def test_defaults_apply_with_no_flags_or_env() -> None:
    s = load_settings(EncoderLike, argv=[], env={})
    assert s == EncoderLike()
    assert s.host == "127.0.0.1" and s.trace_file == Path("var/traces/spans.jsonl")


def test_environment_overrides_defaults_and_flags_override_environment() -> None:
    env = {"EPD_MAX_QUEUE": "8", "EPD_PORT": "5000", "EPD_CHECKSUM": "yes", "EPD_PEERS": "a:1, b:2"}
    s = load_settings(EncoderLike, argv=["--port", "6000", "--no-checksum"], env=env)
    assert s.max_queue == 8
    assert s.port == 6000
    assert s.checksum is False
    assert s.peers == ("a:1", "b:2")


def test_types_are_converted() -> None:
    s = load_settings(EncoderLike, argv=["--batch-timeout-s", "0.25", "--trace-file", "/tmp/x.jsonl"], env={})
    assert s.batch_timeout_s == 0.25
    assert s.trace_file == Path("/tmp/x.jsonl")


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--max-queue", "many"], {}, "--max-queue: 'many' is not a valid int"),
        ([], {"EPD_MAX_QUEUE": "many"}, "EPD_MAX_QUEUE: 'many' is not a valid int"),
        ([], {"EPD_CHECKSUM": "maybe"}, "EPD_CHECKSUM: 'maybe' is not a boolean"),
        (["--log-format", "xml"], {}, "--log-format: 'xml' is not one of json, console"),
        (["--port", "70000"], {}, "--port: 70000 is not a TCP port"),
    ],
)
def test_bad_values_name_their_source(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings(EncoderLike, argv=argv, env=env)
    assert str(caught.value).startswith(message)


def test_unknown_flag_exits_with_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        load_settings(EncoderLike, argv=["--nope"], env={})
    assert caught.value.code == 2
    assert "unrecognized arguments: --nope" in capsys.readouterr().err


def test_help_lists_env_variables_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_settings(EncoderLike, argv=["--help"], env={}, prog="epd-encoder")
    out = capsys.readouterr().out
    assert "--max-queue" in out and "EPD_MAX_QUEUE" in out and "default: 64" in out


def test_prefill_chunk_must_be_positive() -> None:
    from libs.serving.settings import ChunkedPrefillSettings

    @dataclasses.dataclass(frozen=True)
    class PrefillLike(ChunkedPrefillSettings, CommonSettings):
        pass

    assert load_settings(PrefillLike, argv=["--prefill-chunk-tokens", "128"], env={}).prefill_chunk_tokens == 128
    with pytest.raises(SettingsError, match="--prefill-chunk-tokens: 0 is not a positive number of tokens"):
        load_settings(PrefillLike, argv=[], env={"EPD_PREFILL_CHUNK_TOKENS": "0"})


def test_prefill_batch_steps_is_a_pd_setting_and_not_negative() -> None:
    from services.pd.service import PrefillDecodeSettings

    assert load_settings(PrefillDecodeSettings, argv=[], env={}).prefill_batch_steps == 16
    assert load_settings(PrefillDecodeSettings, argv=["--prefill-batch-steps", "0"], env={}).prefill_batch_steps == 0
    with pytest.raises(SettingsError, match="--prefill-batch-steps: -1 is below 0"):
        load_settings(PrefillDecodeSettings, argv=["--prefill-batch-steps", "-1"], env={})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engine-start-timeout-s", "0"], "--engine-start-timeout-s: 0.0 is not a positive number of seconds"),
        (["--engine-hang-timeout-s", "-1"], "--engine-hang-timeout-s: -1.0 is negative"),
        (["--engine-max-restarts", "-1"], "--engine-max-restarts: -1 is negative"),
        (["--engine-backoff-max-s", "0.5"], "--engine-backoff-max-s: 0.5 is less than --engine-backoff-start-s 1.0"),
    ],
)
def test_vllm_engine_life_settings_are_checked(argv: list[str], message: str) -> None:
    from libs.backends.settings import EngineSettings

    life = load_settings(EngineSettings, argv=["--engine-hang-timeout-s", "0", "--engine-max-restarts", "0"], env={})
    assert (life.engine_hang_timeout_s, life.engine_max_restarts) == (0.0, 0)  # watchdog off, no restart
    with pytest.raises(SettingsError, match=message):
        load_settings(EngineSettings, argv=argv, env={})
