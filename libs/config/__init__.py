"""One settings loader for every service: typed dataclass fields filled from flags and environment."""

from libs.config.settings import ClientAuthSettings, CommonSettings, SettingsError, load_settings, setting

__all__ = ["ClientAuthSettings", "CommonSettings", "SettingsError", "load_settings", "setting"]
