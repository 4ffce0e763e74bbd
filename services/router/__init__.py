"""Router: client-facing Generate; splits media into encoder jobs, forwards metadata-only requests."""
