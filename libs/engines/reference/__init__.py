"""The reference engine: the project's own transformers runtime (libs/engine) behind `libs.engines.api`."""
