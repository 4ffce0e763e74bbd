"""OpenAI's HTTP API (chat completions, completions, transcriptions) mapped onto `epd.v1`: request
bodies to `GenerateRequest`s, the `Generate` stream to OpenAI's objects and SSE chunks, gRPC
statuses to OpenAI error objects. Pure functions and pydantic models: the door's application
(`libs/door/app.py`) is a thin adapter over them."""
