"""This process's incarnation id and software version, as advertised in `ServiceInfo`."""

from __future__ import annotations

import uuid

SOFTWARE_VERSION = "epd 0.1.0"
# One id per process incarnation: peers re-check us (and reload NIXL metadata) when it changes.
INSTANCE_ID = uuid.uuid4().hex
