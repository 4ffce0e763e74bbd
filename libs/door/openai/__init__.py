"""OpenAI's HTTP API (chat completions, completions, transcriptions) mapped onto `epd.v1`: request
bodies to `GenerateRequest`s, the `Generate` stream to OpenAI's objects and SSE chunks, gRPC
statuses to OpenAI error objects. Pure functions and pydantic models: the HTTP service
(`services/openai_door`) is a thin adapter over them."""
