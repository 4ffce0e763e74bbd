"""One settings loader for every service: typed dataclass fields filled from flags and environment."""

from libs.config.settings import CommonSettings, SettingsError, load_settings, setting

__all__ = ["CommonSettings", "SettingsError", "load_settings", "setting"]
