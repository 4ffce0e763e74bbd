"""Encoder service (E): media items -> embeddings kept in registered memory + layout metadata."""
