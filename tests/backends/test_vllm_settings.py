"""A vLLM service's settings as vLLM's engine arguments and environment (no engine starts): today's
CPU values by default; any device, memory sizing, host and transport from the service's own
settings; bad values refused naming the flag."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from libs.backends.settings import ChunkedEngineSettings, EngineSettings, PrefillDecodeEngineSettings
from libs.backends.vllm import engine_polling, runtime
from libs.backends.vllm.streams import reads_config
from libs.config import SettingsError, load_settings
from libs.transfer import nixl_package as nixl

pytestmark = pytest.mark.unit
FAILURES = Path("/tmp/failures")
KV = runtime.KvTransfer("kv_producer", "epd-prefill-abc", 45123)
GPU = [
    *("--device", "cuda", "--dtype", "bfloat16", "--no-enforce-eager", "--gpu-memory-utilization", "0.85"),
    *("--tensor-parallel-size", "2", "--host", "10.1.2.3", "--nixl-side-channel-port", "5600"),
    *("--ucx-net-devices", "mlx5_0:1,eth0", "--ucx-tls", "rc,cuda_copy,tcp", "--pool-mib", "1024"),
    "--no-checksum",
    "--max-num-batched-tokens",
    "8192",
]


def _settings(argv: list[str], cls: type[EngineSettings] = ChunkedEngineSettings) -> EngineSettings:
    return load_settings(cls, argv=["--engine", "vllm", *argv], env={})


def _args(settings: EngineSettings, *, ec: bool = True, kv: runtime.KvTransfer | None = KV) -> dict[str, Any]:
    return runtime.engine_args(settings, failure_dir=FAILURES, ec_consumer=ec, kv=kv)


def test_the_defaults_are_todays_cpu_values() -> None:
    settings = _settings([])
    args = _args(settings)
    assert (args["dtype"], args["enforce_eager"], args["tensor_parallel_size"]) == ("float32", False, 1)  # compiled
    assert args["kv_cache_memory_bytes"] == 64 << 20 and "gpu_memory_utilization" not in args
    assert args["long_prefill_token_threshold"] == 64
    assert args["long_prefill_token_threshold_adaptive"] is False  # the prefill service: fixed chunks
    assert "max_num_batched_tokens" not in args  # vLLM's own budget
    assert args["kv_transfer_config"]["kv_buffer_device"] == "cpu"
    assert args["ec_transfer_config"]["ec_connector_extra_config"] == {"failure_dir": str(FAILURES)}
    assert runtime.engine_environment(settings, KV) == {
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "45123",
        "UCX_NET_DEVICES": "lo",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # else vLLM's CPU platform turns "uni" into "mp"
    }
    assert args["distributed_executor_backend"] == "uni"  # the worker inside EngineCore


def test_gpu_settings_reach_the_engine_arguments_and_environment() -> None:
    settings = _settings(GPU)
    args = _args(settings)
    assert (args["dtype"], args["enforce_eager"], args["tensor_parallel_size"]) == ("bfloat16", False, 2)
    # A memory fraction replaces the explicit KV bytes: vLLM sizes the cache itself.
    assert args["gpu_memory_utilization"] == 0.85 and "kv_cache_memory_bytes" not in args
    assert args["kv_transfer_config"]["kv_buffer_device"] == "cuda"
    assert args["max_num_batched_tokens"] == 8192
    assert set(args["ec_transfer_config"]["ec_connector_extra_config"]) == {"failure_dir"}  # no NIXL in the worker
    assert "distributed_executor_backend" not in args  # two devices: vLLM's own choice
    # No CPU thread binding on a GPU; the host is the service's --host; the side channel is fixed.
    kv = runtime.KvTransfer("kv_consumer", "epd-decode-abc", runtime.side_channel_port(settings))
    assert runtime.engine_environment(settings, kv) == {
        "VLLM_HOST_IP": "10.1.2.3",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.1.2.3",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600",
        "UCX_NET_DEVICES": "mlx5_0:1,eth0",
        "UCX_TLS": "rc,cuda_copy,tcp",
    }


def test_the_engine_host_ip_overrides_the_listen_address_and_the_side_channel_port_is_free_there() -> None:
    settings = _settings(["--host", "0.0.0.0", "--engine-host-ip", "127.0.0.1"])
    env = runtime.engine_environment(settings)
    assert env["VLLM_HOST_IP"] == env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in env  # no KV connector: no side channel
    port = runtime.side_channel_port(settings)  # 0: a free port on the engine's address
    assert 0 < port <= 65535


def test_the_pd_takes_its_chunk_as_a_floor_unless_told_not_to() -> None:
    pd = _args(_settings(["--prefill-chunk-tokens", "32"], PrefillDecodeEngineSettings), kv=None)
    assert (pd["long_prefill_token_threshold"], pd["long_prefill_token_threshold_adaptive"]) == (32, True)
    argv = ["--prefill-chunk-tokens", "32", "--no-prefill-chunk-fair-share"]
    fixed = _args(_settings(argv, PrefillDecodeEngineSettings), kv=None)
    assert (fixed["long_prefill_token_threshold"], fixed["long_prefill_token_threshold_adaptive"]) == (32, False)


def test_decode_and_pd_get_no_chunking_and_decode_no_encoder_cache() -> None:
    settings = _settings([], EngineSettings)
    args = _args(settings, ec=False, kv=runtime.KvTransfer("kv_consumer", "epd-decode-abc", 1))
    assert "long_prefill_token_threshold" not in args and "long_prefill_token_threshold_adaptive" not in args
    assert "ec_transfer_config" not in args
    pd = _args(settings, kv=None)
    assert "kv_transfer_config" not in pd and "worker_extension_cls" not in pd


def test_the_embedding_reads_follow_the_services_transport_settings_into_a_shared_pool() -> None:
    config = reads_config(_settings(GPU), "prefill")
    assert config.pool_bytes == 1024 << 20 and not config.verify_checksum
    assert config.shared_pool  # vLLM's worker maps it and copies each item from there
    assert config.ucx_environment()["UCX_NET_DEVICES"] == "mlx5_0:1,eth0"
    assert config.ucx_environment()["UCX_TLS"] == "rc,cuda_copy,tcp"
    default = reads_config(_settings([]), "pd")
    assert default.pool_bytes == 256 << 20 and default.verify_checksum and default.shared_pool
    assert "UCX_TLS" not in default.ucx_environment() and default.ucx_environment()["UCX_NET_DEVICES"] == "lo"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: 1.5 is not a fraction in"),
        (["--kv-cache-mib", "0"], "--kv-cache-mib: 0 MiB with no --gpu-memory-utilization"),
        (["--dtype", "float64"], "--dtype: 'float64' is not one of"),
        (["--device", " "], "--device: empty"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size: 0 is not >= 1"),
        (["--max-num-batched-tokens", "-1"], "--max-num-batched-tokens: -1 is not >= 0"),
        (["--nixl-side-channel-port", "70000"], "--nixl-side-channel-port: 70000 is not a TCP port"),
        (["--engine-cpus", "4096"], "--engine-cpus: CPU 4096 is not on this host"),
        (["--engine-cpus", "-1"], "--engine-cpus: CPU -1 is not on this host"),
        (["--host", "0.0.0.0"], "--engine-host-ip: needed with --host '0.0.0.0'"),
    ],
)
def test_bad_engine_settings_are_refused_naming_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        _settings(argv)


def test_the_engine_busy_poll_window_reaches_the_engine_processes_when_set() -> None:
    assert engine_polling.ENV not in runtime.engine_environment(_settings([]), KV)  # vLLM's own window
    env = runtime.engine_environment(_settings(["--engine-busy-poll-s", "0"]), KV)
    assert env[engine_polling.ENV] == "0.0"


@pytest.mark.parametrize(
    ("argv", "backend"),
    [
        ([], "uni"),
        (["--distributed-executor-backend", "mp"], "mp"),
        (["--tensor-parallel-size", "2"], None),
        (["--device", "cuda"], None),
        (["--device", "cuda", "--distributed-executor-backend", "uni"], "uni"),
    ],
)
def test_the_worker_runs_inside_enginecore_on_one_cpu_engine_unless_told(argv: list[str], backend: str | None) -> None:
    settings = _settings(argv)
    assert _args(settings).get("distributed_executor_backend") == backend
    # The variable only where vLLM's CPU platform would otherwise spawn a Worker anyway.
    cpu_uni = backend == "uni" and settings.device == "cpu"
    assert ("VLLM_ENABLE_V1_MULTIPROCESSING" in runtime.engine_environment(settings, KV)) == cpu_uni


def test_a_wildcard_host_is_fine_for_the_reference_engine() -> None:
    assert load_settings(EngineSettings, argv=["--host", "0.0.0.0"], env={}).engine == "reference"


def test_nixl_is_imported_by_one_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    nixl.nixl_package.cache_clear()
    try:
        chosen = nixl.nixl_package()
        assert chosen in nixl.BUILDS  # here: the meta package's pick (nixl_cu12 on a host with no CUDA)
        # vLLM's `nixl._api` is the very module the project's agents and connector patch use.
        assert nixl.nixl_module("_api") is sys.modules["nixl._api"]
        nixl.nixl_package.cache_clear()
        monkeypatch.setenv(nixl.ENV, "nixl_cu99")
        with pytest.raises(ImportError, match="EPD_NIXL_PACKAGE=nixl_cu99: no such package installed"):
            nixl.nixl_package()
        nixl.nixl_package.cache_clear()
        monkeypatch.setenv(nixl.ENV, chosen)
        assert nixl.nixl_package() == chosen
    finally:
        nixl.nixl_package.cache_clear()
