"""Hook specifications. Plugins implement them as module-level ``@anyquant.hookimpl`` functions.

All hooks collect every answer (none is ``firstresult``): detection must see every claimant.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import pluggy

if TYPE_CHECKING:
    import argparse

    from .probe import Probe
    from .protocols import BackendSpec, Claim, FormatSpec

__all__ = ["CalibrationRegistrar", "CommandRegistrar", "hookimpl", "hookspec"]


class CalibrationRegistrar(Protocol):
    """What ``anyquant_register_calibration`` gets: ``register(name, loader, description="")``."""

    def __call__(self, name: str, loader: Callable[[int, int, int], list[str]], description: str = "") -> None: ...


class CommandRegistrar(Protocol):
    """What ``anyquant_register_commands`` gets."""

    def add_command(
        self,
        name: str,
        help: str,
        configure: Callable[[argparse.ArgumentParser], None],
        run: Callable[[argparse.Namespace], int],
    ) -> None: ...


hookspec = pluggy.HookspecMarker("anyquant")
hookimpl = pluggy.HookimplMarker("anyquant")


@hookspec
def anyquant_register_formats(register: Callable[[FormatSpec], None]) -> None:
    """Register the formats this plugin owns: call ``register(FormatSpec(...))`` once per format.

    Registering a format id another plugin already registered is an error (the second plugin is
    skipped and reported by ``anyquant plugins``).

    .. versionadded:: 0.1
    """


@hookspec
def anyquant_register_backends(register: Callable[[BackendSpec], None]) -> None:
    """Register the backends this plugin provides: call ``register(BackendSpec(...))`` once per backend (its
    name, the devices and packed layouts it runs, and where its availability check lives).

    A format's loader offers a registered backend for the layouts its layers come in, and
    :func:`anyquant.backends.choose_backend` picks among them; registering a backend name another plugin
    already registered is an error (the second plugin is skipped and reported by ``anyquant plugins``).

    .. versionadded:: 0.1
    """


@hookspec
def anyquant_detect(probe: Probe) -> Claim | None:
    """Look at ``probe`` (config files and tensor headers; never tensor data) and return a
    :class:`~anyquant.Claim` if the checkpoint is in one of your formats, else ``None``.

    Must be pure and cheap: no torch, no file reads beyond what the probe holds. Every plugin is
    asked; core requires exactly one claim.

    .. versionadded:: 0.1
    """


@hookspec
def anyquant_register_calibration(register: CalibrationRegistrar) -> None:
    """Register named calibration sources: ``register(name, loader)`` where ``loader(n_samples,
    seq_len, seed) -> list[str]``.

    .. versionadded:: 0.1
    """


@hookspec
def anyquant_register_commands(cli: CommandRegistrar) -> None:
    """Add CLI subcommands. ``cli.add_command(name, help, configure, run)``: ``configure(parser)``
    adds arguments to an ``argparse`` parser (called only when the command is the one being run),
    ``run(args) -> int`` executes. anyquant's own commands register this way too (:mod:`anyquant.commands`).

    .. versionadded:: 0.1
    """
