"""Engine arguments as command-line flags, shared by every entry point.

The command (`cli.py`), the server's flags (`openai/cli_args.py`), the server itself and
Ray Serve import this module; it imports none of them, so the entry points read one way:
command -> server/demo/Ray pieces -> this. It imports only `config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from vllm_tpu_lora.config import EngineArgs

# Not flags: the model is positional or its own flag per command, and precompiling is
# what a served engine always does.
_SKIP = {"model", "precompile"}


def _flag_type(hint) -> type | None:
    hint = str(hint)
    if "bool" in hint:
        return None
    if "int" in hint:
        return int
    return str


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every EngineArgs field as a --kebab-case flag, vLLM style."""
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        if f.name in _SKIP:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _flag_type(hints[f.name])
        if "list" in str(hints[f.name]):
            parser.add_argument(flag, nargs="+", type=kind, default=f.default)
        elif kind is None and f.default is not False:  # on, or decided: --flag / --no-flag
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif kind is None:
            parser.add_argument(flag, action="store_true", default=f.default)
        else:
            parser.add_argument(flag, type=kind, default=f.default)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The parsed engine flags as `LLM(model, **kwargs)` / `EngineArgs` keyword arguments."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)
            if f.name not in _SKIP}
