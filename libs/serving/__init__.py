"""Serving glue shared by the services: conversions between epd.v1 messages and engine types,
and engine errors as typed contract errors. The engine never sees protobuf; the services never
hand-convert fields."""
