"""`vllm-tpu-lora` command line: `generate` (offline), `demo`, `serve` and `serve-ray`.

The top of the entry points: it imports the pieces (demo, server, Ray), none of which
imports it back; the flags they share live in `args.py`. The server and Ray Serve are
imported only when their command runs (Ray is an optional extra)."""

from __future__ import annotations

import argparse
import json
import sys

from vllm_tpu_lora.entrypoints.args import add_engine_args, engine_kwargs
from vllm_tpu_lora.entrypoints.demo import add_demo_args
from vllm_tpu_lora.entrypoints.openai.cli_args import add_server_args
from vllm_tpu_lora.entrypoints.ray_args import add_ray_args


def _generate(args: argparse.Namespace) -> int:
    from vllm_tpu_lora import LLM, SamplingParams
    from vllm_tpu_lora.lora.request import LoRARequest

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed,
                            n=args.n, stop=args.stop or None, ignore_eos=args.ignore_eos)
    lora = LoRARequest(args.lora_name or "adapter", 1, args.lora_path) if args.lora_path else None
    outs = llm.generate(args.prompt, params, use_tqdm=False, lora_request=lora)
    for out in outs:
        for c in out.outputs:
            if args.json:
                print(json.dumps({"prompt": out.prompt, "index": c.index, "text": c.text,
                                  "token_ids": c.token_ids, "finish_reason": c.finish_reason}))
            else:
                print(f"{out.prompt!r} -> {c.text!r} [{c.finish_reason}]")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from vllm_tpu_lora.entrypoints.openai.api_server import run

    return run(args)


def _serve_ray(args: argparse.Namespace) -> int:
    try:
        from vllm_tpu_lora.entrypoints.ray_serve import run
    except ImportError as e:
        raise ValueError(f"serve-ray needs Ray Serve: pip install -e \".[ray]\" ({e})") from None
    return run(args)


def _demo(args: argparse.Namespace) -> int:
    from vllm_tpu_lora.entrypoints.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-tpu-lora")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions offline")
    gen.add_argument("--model", required=True, help="HF checkpoint directory")
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--lora-path", default=None, help="a PEFT adapter directory to apply")
    gen.add_argument("--lora-name", default=None)
    gen.add_argument("--json", action="store_true", help="one JSON object per completion")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)
    demo = sub.add_parser("demo", help="the bundled model and adapters in one mixed batch")
    add_demo_args(demo)
    demo.set_defaults(func=_demo)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible server (no model: the "
                                         "bundled demo model with its adapters)")
    add_server_args(serve, positional_model=True)
    serve.set_defaults(func=_serve)
    ray = sub.add_parser("serve-ray", help="the same server as N engine replicas on Ray Serve, "
                                           "routing each request to a replica holding its "
                                           "adapter (needs the [ray] extra)")
    add_server_args(ray, positional_model=True)
    add_ray_args(ray)
    ray.set_defaults(func=_serve_ray)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
