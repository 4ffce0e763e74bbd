"""OpenAI-compatible HTTP front door of an EPD stack (in front of the router)."""
