"""The OpenAI-compatible HTTP API of an EPD stack over the router's `Generate` (docs/openai-door.md),
one component wherever it runs: the mapping of OpenAI's bodies, streams and errors (`openai`), the
application (`app`), its accounting of every response (`guard`), how it reaches the router
(`calls`), its server and settings (`server`) and its connections' bounds (`connections`), and what
the router's own process needs to serve it (`in_process`). Its own process is
services/openai_door."""
