"""anyquant-tools' plugin: its commands, registered through the command hook as core's built-in ones are
(``anyquant quantize``, ``export``, ``eval``, ``compare``, ``check``, ``estimate``, ``advise``, ``calibration``)."""

from __future__ import annotations

import importlib

from anyquant.plugin import CommandRegistrar, hookimpl

__all__ = ["COMMANDS", "anyquant_register_commands"]

#: the command modules, in the order ``anyquant --help`` lists them
COMMANDS = (
    "anyquant_tools.commands.quantize",  # quantize
    "anyquant_tools.commands.export",  # export
    "anyquant_tools.commands.evaluate",  # eval, compare
    "anyquant_tools.commands.check",  # check
    "anyquant_tools.commands.sizing",  # estimate, advise
    "anyquant_tools.commands.calibration",  # calibration list|sample|check
)


@hookimpl
def anyquant_register_commands(cli: CommandRegistrar) -> None:
    for module in COMMANDS:
        importlib.import_module(module).anyquant_register_commands(cli=cli)
