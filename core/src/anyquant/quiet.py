"""Dependencies' import-time noise kept out of anyquant's own command line and demo, for their duration only.

Importing transformers' model code pulls in torchao, which logs "Failed to load ... .so" for each optional CUDA
extension a machine lacks, and makes torch log that registering its enums is deprecated; AutoAWQ warns at import
that it is deprecated. None of it is about the user's run, and every CLI command that loads a model repeated it.

:func:`quiet_dependencies` drops exactly those records and warnings while it is active and puts everything back
on exit: a library user's warning filters and loggers are never changed (``import anyquant`` and its library
calls do not use it; :func:`anyquant.cli.main` and ``examples/demo.py`` do, around one command). Standard
library only.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

__all__ = ["NOISY_LOGGERS", "NOISY_WARNING_MODULES", "quiet_dependencies"]

#: logger -> text of the records dropped (torchao's optional extensions; torch's notice about its own enums)
NOISY_LOGGERS: dict[str, tuple[str, ...]] = {
    "torchao": ("Failed to load ",),
    "torch.utils._pytree": ("is an Enum subclass",),
}
#: modules whose import-time deprecation warnings are dropped (AutoAWQ's notice, torchao's)
NOISY_WARNING_MODULES = r"(awq|torchao)(\.|$)"
_NOISY_FILE = re.compile(r"[/\\](awq|torchao)[/\\]")


class _DropNoise(logging.Filter):
    def __init__(self, texts: tuple[str, ...]) -> None:
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in self.texts)


@contextmanager
def quiet_dependencies() -> Iterator[None]:
    """Drop the dependencies' import-time notices listed above while active; everything else passes.

    Warning filters are saved and restored (:func:`warnings.catch_warnings`: meant for the main thread of a
    process that runs one command, as the CLI and the demo are), and the logging filters added are removed."""
    added = []
    for name, texts in NOISY_LOGGERS.items():
        logger, drop = logging.getLogger(name), _DropNoise(texts)
        logger.addFilter(drop)
        added.append((logger, drop))
    try:
        with warnings.catch_warnings():  # restores the filters and showwarning, whatever an import did to them
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=NOISY_WARNING_MODULES)
            warnings.filterwarnings("ignore", category=FutureWarning, module=NOISY_WARNING_MODULES)
            # AutoAWQ's import puts its own "default" filter for DeprecationWarning in front of these before it
            # warns: its notice is dropped where it is shown
            show = warnings.showwarning

            def showwarning(
                message: Warning | str,
                category: type[Warning],
                filename: str,
                lineno: int,
                file: TextIO | None = None,
                line: str | None = None,
            ) -> None:
                if not (issubclass(category, (DeprecationWarning, FutureWarning)) and _NOISY_FILE.search(filename)):
                    show(message, category, filename, lineno, file, line)

            warnings.showwarning = showwarning
            yield
    finally:
        for logger, drop in added:
            logger.removeFilter(drop)
