"""`epd up`: run a stack in the foreground until Ctrl-C, as `docker compose up` does.

It holds its run directory (libs/launch/rundir.py: a second `epd up` there is refused), prints
where to reach the stack (the router's gRPC address; the OpenAI door's base URL and a curl command
that works as pasted), and on Ctrl-C says at once that it is stopping, reports each service as it
exits (each drains first), and kills them all on a second Ctrl-C.
"""

from __future__ import annotations

import http.client
import json
import shlex
import signal
import ssl
import sys
import threading
import urllib.request

from libs.backends.engines import model_type
from libs.cli.router_client import ADDRESS_FILE, DEFAULT_RUN_DIR
from libs.launch.process import LaunchError
from libs.launch.rundir import RunDirLock
from libs.launch.runs import Run, shown
from libs.launch.stack import CLIENT_TOKEN, Stack
from libs.launch.supervisor import Supervisor


def served_model(stack: Stack) -> str:
    """The model id the door answers to, as its /v1/models says (a stack description may rename
    it: served_model_name); the checkpoint's name when it does not answer."""
    request = urllib.request.Request(f"{stack.door_url}/models")
    context = None
    try:
        if stack.spec.tls:
            context = ssl.create_default_context(cafile=str(stack.tls_dir / "ca.pem"))
            request.add_header("Authorization", f"Bearer {(stack.tls_dir / CLIENT_TOKEN).read_text().strip()}")
        with urllib.request.urlopen(request, timeout=10, context=context) as reply:
            return str(json.loads(reply.read())["data"][0]["id"])
    except (OSError, ValueError, KeyError, IndexError, TypeError, http.client.HTTPException):
        return stack.spec.model.name


def door_lines(stack: Stack) -> list[str]:
    """How to reach the OpenAI door: the base URL an OpenAI client takes and one request that works
    as pasted (a chat completion; a transcription on a speech model, which takes no chat)."""
    model = served_model(stack)
    base = stack.door_url
    curl = ["curl", "-s"]
    if stack.spec.tls:
        token = stack.tls_dir / CLIENT_TOKEN
        curl += ["--cacert", str(stack.tls_dir / "ca.pem")]
        auth = f'-H "Authorization: Bearer $(cat {shlex.quote(str(token))})"'
    else:
        auth = ""
    if model_type(stack.spec.model) == "whisper":
        request = [f"{base}/audio/transcriptions", "-F", "file=@speech.wav", "-F", f"model={model}"]
    else:
        body = {"model": model, "messages": [{"role": "user", "content": "Hello"}]}
        request = [f"{base}/chat/completions", "-H", "Content-Type: application/json", "-d", json.dumps(body)]
    command = shlex.join([*curl, *request]) + (f" {auth}" if auth else "")
    return [
        f"OpenAI-compatible API (model {model}): base_url={base}",
        f"  {command}",
    ]


def run_up(stack: Stack, lock: RunDirLock, supervise: bool, run: Run) -> int:
    """Start `stack`, serve until Ctrl-C / SIGTERM (or a service dies unsupervised), stop it; the
    run directory is free again however this ends. `run`: where this run's logs and spans go."""
    try:
        return _serve(stack, lock, supervise, run)
    finally:
        lock.release()


def where_it_writes(stack: Stack, run: Run) -> list[str]:
    """Where this run's logs and spans are, and how to read them."""
    lines = [
        f"logs of this run: {shown(run.dir)}/<service>.log (JSON lines), <service>.native.log (each process's "
        "stdout and stderr: native libraries' output)"
    ]
    if run.trace_file is not None:
        report = "epd trace report" + (
            "" if stack.spec.run_dir == DEFAULT_RUN_DIR else f" --run-dir {stack.spec.run_dir}"
        )
        lines.append(f"spans of this run: {shown(run.trace_file)} (`{report}`)")
    return lines


def _serve(stack: Stack, lock: RunDirLock, supervise: bool, run: Run) -> int:
    try:
        address = stack.up()
    except LaunchError as exc:
        print(f"epd up: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while starting: Stack.up stopped what had started
        print("epd up: interrupted while starting; stopped what had started", file=sys.stderr)
        return 130
    supervisor = None
    if supervise:
        supervisor = Supervisor(stack, on_event=lambda role, event: print(f"epd up: {role} {event}", flush=True))
        supervisor.start()
    run_dir = stack.spec.run_dir
    lock.write(run_dir / ADDRESS_FILE, address)
    pids = ", ".join(f"{name} {p.pid}" for name, p in stack.processes.items())
    print(f"router listening on {address}  ({stack.spec.layout}; {pids}; logs in {shown(run.dir)})", flush=True)
    print("\n".join(where_it_writes(stack, run)), flush=True)
    if stack.door_url:
        print("\n".join(door_lines(stack)), flush=True)
    if stack.spec.tls:
        print(f"TLS: clients need {stack.tls_dir / 'ca.pem'} and the token in {stack.tls_dir / CLIENT_TOKEN}")
    print("Ctrl-C stops the stack.", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(0.5):
        dead = [name for name, p in stack.processes.items() if not p.alive()]
        if dead and supervisor is None:
            print(f"epd up: {', '.join(dead)} exited; stopping the stack", file=sys.stderr)
            break
    # Said before anything slow: each service drains for up to its grace period.
    print("stopping the stack (each service finishes its requests first; Ctrl-C again kills them) ...", flush=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C: KeyboardInterrupt
    try:
        if supervisor is not None:
            supervisor.stop()
        statuses = stack.down(on_stopped=lambda name, status: print(f"  {name} exited ({status})", flush=True))
    except KeyboardInterrupt:
        print("killing the services ...", flush=True)
        statuses = stack.kill()
    print(f"stopped: {statuses}", flush=True)
    return 0
