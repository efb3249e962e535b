"""``skuforge keys``: the signing key publish uses, and new keys for CI secrets."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline.project.config import load_registry
from pipeline.results.signing import ENV_SIGNING_KEY, aliases_accepting, generate_key_file, signing_key


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
