"""The reference engine: the project's own transformers runtime (libs/runtime) behind `libs.backends.api`."""
