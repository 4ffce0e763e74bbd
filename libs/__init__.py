"""Shared code of the EPD services, one package per concept (contract, config, telemetry, ...)."""
