"""Media decoding with hard limits: Pillow for images, PyAV for video and audio."""
