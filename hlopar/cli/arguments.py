"""The command lines' argument parser: argparse, plus "did you mean" for a misspelled option
(`--microbatch` -> `--microbatches`), which argparse of Python 3.11 does not offer."""

from __future__ import annotations

import argparse
from typing import NoReturn

from hlopar.ir.suggestions import did_you_mean

__all__ = ["ArgumentParser"]

_UNRECOGNIZED = "unrecognized arguments: "


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        if message.startswith(_UNRECOGNIZED):
            known = [s for action in self._actions for s in action.option_strings]
            hints = []
            for word in message[len(_UNRECOGNIZED) :].split():
                name = word.split("=", 1)[0]
                if name.startswith("--"):
                    hint = did_you_mean(name, known, prefix="--")
                    hints.append(f"'{name}'{hint}" if hint else "")
            message += "".join(f"\n  {h}" for h in hints if h)
        super().error(message)
