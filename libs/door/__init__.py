"""The OpenAI-compatible HTTP API of an EPD stack over the router's `Generate` (docs/openai-door.md):
the application (`app`), how it reaches the router (`calls`) and its server (`server`)."""
