"""Speech transcription logic that needs no torch (the router runs it): long-form windows."""
