"""Each role's settings class, as the stack description and the Kubernetes manifests name the roles."""

from __future__ import annotations

from services.colocated.service import ColocatedSettings
from services.decode.service import DecodeSettings
from services.encoder.service import EncoderSettings
from services.openai_door.service import DoorSettings
from services.pd.service import PrefillDecodeSettings
from services.prefill.service import PrefillSettings
from services.router.service import RouterSettings

SETTINGS = {
    "router": RouterSettings,
    "encoder": EncoderSettings,
    "prefill": PrefillSettings,
    "decode": DecodeSettings,
    "pd": PrefillDecodeSettings,
    "colocated": ColocatedSettings,
    "openai_door": DoorSettings,
}
