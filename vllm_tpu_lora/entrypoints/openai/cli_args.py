"""The server's command-line flags (vLLM's names), kept free of heavy imports so that
`vllm-tpu-lora --help` and argument errors are instant."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from vllm_tpu_lora.entrypoints.args import add_engine_args
from vllm_tpu_lora.entrypoints.openai.protocol import LoRAModulePath


class LoRAParserAction(argparse.Action):
    """--lora-modules in either form: `name=path`, or JSON
    `{"name": ..., "path": ..., "base_model_name": ...}` (or a JSON list of such objects)."""

    def __call__(self, parser, namespace, values: str | Sequence[str] | None,
                 option_string: str | None = None) -> None:
        if isinstance(values, str):
            raise TypeError("Expected values to be a list")
        modules: list[LoRAModulePath] = []
        for item in values or []:
            if not item:
                continue
            if "=" in item and "," not in item and not item.lstrip().startswith("{"):
                name, _, path = item.partition("=")
                if not name or not path:
                    parser.error(f"Invalid --lora-modules value {item!r}: expected name=path")
                modules.append(LoRAModulePath(name, path))
                continue
            try:
                loaded = json.loads(item)
            except json.JSONDecodeError:
                parser.error(f"Invalid JSON format for --lora-modules: {item}")
            for entry in loaded if isinstance(loaded, list) else [loaded]:
                try:
                    modules.append(LoRAModulePath(**entry))
                except TypeError as e:
                    parser.error(f"Invalid fields for --lora-modules: {item} - {e}")
        setattr(namespace, self.dest, modules)


def add_server_args(parser: argparse.ArgumentParser, *, positional_model: bool) -> None:
    """Everything `serve` takes: the model, the frontend flags and every engine arg."""
    if positional_model:
        parser.add_argument("model_tag", nargs="?", default=None,
                            help="HF checkpoint directory to serve (or use --model)")
    parser.add_argument("--model", default=None, help="HF checkpoint directory to serve")
    parser.add_argument("--host", default=None, help="host name (default: all interfaces)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) the API answers to; the first is reported in "
                             "responses (default: the model path)")
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on /v1 (or VLLM_API_KEY)")
    parser.add_argument("--lora-modules", type=str, nargs="+", default=None,
                        action=LoRAParserAction,
                        help="LoRA adapters: name=path, or JSON "
                             '\'{"name": "n", "path": "p", "base_model_name": "id"}\'')
    parser.add_argument("--allowed-lora-dirs", nargs="+", default=None,
                        help="adapters may only be loaded from under these directories "
                             "(checked on the real path: no escape by `..` or symlinks)")
    parser.add_argument("--lora-resolver-uri", dest="lora_resolver_uris", action="append",
                        default=None, metavar="URI",
                        help="resolve unknown adapter names from here, in order (repeatable): "
                             "s3://BUCKET/PREFIX, a directory or file:// URI, hf-cache:// "
                             "(needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora)")
    parser.add_argument("--lora-resolver-cache-dir", default=None,
                        help="where resolvers download adapters (default: "
                             "~/.cache/vllm_tpu_lora/lora_resolver)")
    parser.add_argument("--lora-resolver-cache-gb", type=float, default=10.0,
                        help="bound of that cache; least recently used adapters go first")
    parser.add_argument("--chat-template", default=None,
                        help="a chat template file, or the template itself")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    add_engine_args(parser)


def model_of(args: argparse.Namespace) -> str:
    model = getattr(args, "model_tag", None) or args.model
    if not model:
        raise ValueError("No model given: pass it as `serve MODEL` or --model MODEL")
    if getattr(args, "model_tag", None) and args.model and args.model != args.model_tag:
        raise ValueError(f"Two different models given: {args.model_tag!r} and --model "
                         f"{args.model!r}")
    return model


def apply_demo_defaults(args: argparse.Namespace) -> None:
    """`serve` with no model: the bundled model, with the bundled adapters registered."""
    from vllm_tpu_lora.assets import demo_adapters, demo_model_dir

    args.model = demo_model_dir()
    args.enable_lora = True
    args.max_loras = max(args.max_loras, len(demo_adapters()))
    given = {m.name for m in args.lora_modules or []}
    args.lora_modules = list(args.lora_modules or []) + [
        LoRAModulePath(name, path) for name, path in demo_adapters().items() if name not in given]
    args.served_model_name = args.served_model_name or ["demo"]


def make_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_tpu_lora.entrypoints.openai.api_server",
        description="OpenAI-compatible server for vllm_tpu_lora")
    add_server_args(parser, positional_model=False)
    return parser
