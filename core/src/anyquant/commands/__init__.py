"""anyquant's built-in commands, shipped as default plugins: each module here implements
``anyquant_register_commands`` exactly as a third party's plugin does (``cli.add_command(name, help, configure,
run)``). :mod:`anyquant.cli` calls these first, in this order, without any plugin discovery (so ``anyquant
--help`` lists them and stays fast), then, for a command that is not one of them, every installed plugin's
(anyquant-tools' ``quantize``, ``eval`` ..., anyquant-serve's ``serve``).
"""

from __future__ import annotations

__all__ = ["DEFAULT_COMMANDS"]

#: the modules of the built-in commands, in the order ``anyquant --help`` lists them
DEFAULT_COMMANDS = (
    "anyquant.commands.checkpoint",  # detect, inspect, plugins, backends
    "anyquant.commands.generate",  # generate
)
