"""The command line's commands, one module each: ``profile``, ``plan``, ``train``, ``bench``.

Each holds a typer command's options and body, a thin layer over the Python API;
:mod:`memfit.cli` only wires them into the ``memfit`` app. The top floor: a command may import
anything in memfit, and nothing in memfit imports a command.
"""
