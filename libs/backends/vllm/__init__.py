"""The vLLM engine behind `libs.backends.api`: AsyncLLM in the service, the project's EC connector in
vLLM's worker. Importing this package does not import vLLM (its modules do, when used)."""
