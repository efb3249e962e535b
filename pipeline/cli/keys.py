"""``skuforge keys``: the signing key publish uses, and new keys for CI secrets."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline.project.config import load_registry
from pipeline.results.signing import ENV_SIGNING_KEY, aliases_accepting, generate_key_file, signing_key


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
    s.set_defaults(func=show)

    g = ksub.add_parser(
        "generate",
        help="write a new private key (PEM, mode 0600), e.g. for the CI secret "
        "SKUFORGE_SIGNING_KEY, and print its public key",
    )
    g.add_argument("--out", type=Path, required=True, help="the file to write; an existing one is not overwritten")
    g.add_argument("--name", default="ci", help="key name in the params.yaml line (default: ci)")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=generate)


def _describe(key, name: str) -> dict:
    return {
        "key_id": key.key_id,
        "source": key.source,
        "public_key": key.public_key,
        "params_line": f"release.signing.keys.{name}: {key.public_key}",
    }


def _trust(args: argparse.Namespace, public_key: str) -> list[str] | None:
    """Aliases this key's versions may reach, when params.yaml is at hand."""
    if not Path(args.params).is_file():
        return None

    release = load_registry(args.params).release
    return aliases_accepting(release.signing, release.aliases, public_key)


def show(args: argparse.Namespace) -> int:

    key = signing_key()
    data = _describe(key, args.name or ("ci" if key.source.endswith(ENV_SIGNING_KEY) else "dev"))
    data["trusted_for"] = _trust(args, key.public_key)
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    print(f"key id:      {data['key_id']}")
    print(f"source:      {data['source']}")
    if data["trusted_for"] is not None:
        reaches = ", ".join(data["trusted_for"]) or "(no alias: add the line below to params.yaml and trust it)"
        print(f"reaches:     {reaches}")
    print("for params.yaml:")
    print(f"  {data['params_line']}")
    return 0


def generate(args: argparse.Namespace) -> int:

    key = generate_key_file(args.out)
    data = _describe(key, args.name)
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    print(f"wrote {args.out} (mode 0600): store its content as the secret {ENV_SIGNING_KEY}, then delete it")
    print(f"key id:      {data['key_id']}")
    print("for params.yaml:")
    print(f"  {data['params_line']}")
    return 0
