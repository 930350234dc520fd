"""`serve-ray`'s own flags (no Ray import: `--help` works without the [ray] extra)."""

from __future__ import annotations

import argparse
import json


def add_ray_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-replicas", type=int, default=1,
                        help="engine replicas (each owns one engine and its devices)")
    parser.add_argument("--ray-address", default=None,
                        help="join this running Ray cluster (default: start a local one)")
    parser.add_argument("--replica-num-cpus", type=float, default=1.0,
                        help="CPUs Ray reserves per replica")
    parser.add_argument("--replica-resources", type=json.loads, default=None,
                        help='other Ray resources per replica as JSON, e.g. \'{"TPU": 4}\'')
    parser.add_argument("--no-adapter-affinity", dest="adapter_affinity",
                        action="store_false",
                        help="route without Serve's model multiplexing (for comparison)")
