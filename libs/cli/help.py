"""How every `epd` command's `--help` reads: each option shows its default, the way `vllm serve
--help` does, so nobody has to read the source to learn what an omitted flag means."""

from __future__ import annotations

import argparse


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" after every option's help, except where there is nothing to show:
    a flag that is off unless given, a None or empty string that means "not set" (its help says
    what happens then), or a help text that states the default itself."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        # False by identity: 0 and 0.0 equal it, and they are defaults worth showing.
        unset = action.default in (None, "", argparse.SUPPRESS) or action.default is False
        if "default" in text or unset:
            return text
        return super()._get_help_string(action)


class EpdParser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows defaults; its subcommands' parsers are of this class too
    (`add_subparsers` makes parsers of the parent's class)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
