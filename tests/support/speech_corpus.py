"""Known-text speech for the Whisper tests and the WER measurement: Harvard sentences (IEEE 1969
recommended practice for speech quality measurements; public domain), read by espeak-ng."""

from __future__ import annotations

from functools import cache

from libs.speech.synth import speak

HARVARD = (
    "The birch canoe slid on the smooth planks.",
    "Glue the sheet to the dark blue background.",
    "It's easy to tell the depth of a well.",
    "These days a chicken leg is a rare dish.",
    "Rice is often served in round bowls.",
    "The juice of lemons makes fine punch.",
    "The box was thrown beside the parked truck.",
    "The hogs were fed chopped corn and garbage.",
    "Four hours of steady work faced us.",
    "A large size in stockings is hard to sell.",
    "The boy was there when the sun rose.",
    "A rod is used to catch pink salmon.",
    "The source of the huge river is the clear spring.",
    "Kick the ball straight and follow through.",
    "Help the woman get back to her feet.",
    "A pot of tea helps to pass the evening.",
    "Smoky fires lack flame and heat.",
    "The soft cushion broke the man's fall.",
    "The salt breeze came across from the sea.",
    "The girl at the booth sold fifty bonds.",
    "The small pup gnawed a hole in the sock.",
    "The fish twisted and turned on the bent hook.",
    "Press the pants and sew a button on the vest.",
    "The swan dive was far short of perfect.",
)

# Over 30 s when read at 150 words per minute: long-form transcription, several windows.
LONG_TEXT = " ".join(HARVARD[:14])

# Utterances of different lengths for the split-equals-generate checks (the last is long-form).
UTTERANCES = {
    "short": (HARVARD[3], 160),
    "medium": (" ".join(HARVARD[4:6]), 160),
    "fast": (" ".join(HARVARD[6:9]), 220),
    "twenty_seconds": (" ".join(HARVARD[11:19]), 170),
    "long_form": (LONG_TEXT, 150),
}


@cache
def utterance(text: str, words_per_minute: int = 160) -> bytes:
    return speak(text, words_per_minute=words_per_minute)
