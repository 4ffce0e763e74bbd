"""A stand-in service that writes what a real one's process writes, each the way it does: JSON log
lines through the project's logger (structlog and stdlib), a Python warning, native libraries'
text straight to fds 2 and 1 (Mooncake's glog before InitGoogleLogging, a C library's printf), its
listening line on stdout; then it dies of an uncaught exception."""

import logging
import os
import warnings

import structlog

from libs.telemetry import configure_logging

configure_logging("noisy")
structlog.get_logger("noisy").info("starting", items=2)
os.write(2, b"WARNING: Logging before InitGoogleLogging() is written to STDERR\n")
os.write(2, b"I1207 23:03:33.211433 12794 client_metric.cpp:102] Client metrics enabled\n")
os.write(1, b"[1765148613.211] ucx  native line on stdout\n")
logging.getLogger("grpc.some.module").warning("peer %s gone", "127.0.0.1:1")
warnings.warn("a library's deprecation", DeprecationWarning, stacklevel=1)
print("noisy listening on 127.0.0.1:1", flush=True)
raise RuntimeError("the service failed")
