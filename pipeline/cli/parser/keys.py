"""The arguments of `skuforge keys` (no library import: `--help` stays fast)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    keys = sub.add_parser("keys", help="the ed25519 key publish signs manifests with")
    ksub = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)

    s = ksub.add_parser(
        "show",
        help="this host's signing key (SKUFORGE_SIGNING_KEY, else the developer key, "
        "made on first use) and its line for params.yaml",
    )
    s.add_argument(
        "--name", help="key name in the params.yaml line (default: 'ci' for SKUFORGE_SIGNING_KEY, else 'dev')"
    )
    s.add_argument("--json", action="store_true")
    s.set_defaults(handler="pipeline.cli.keys:show")

    g = ksub.add_parser(
        "generate",
        help="write a new private key (PEM, mode 0600), e.g. for the CI secret "
        "SKUFORGE_SIGNING_KEY, and print its public key",
    )
    g.add_argument("--out", type=Path, required=True, help="the file to write; an existing one is not overwritten")
    g.add_argument("--name", default="ci", help="key name in the params.yaml line (default: ci)")
    g.add_argument("--json", action="store_true")
    g.set_defaults(handler="pipeline.cli.keys:generate")
