"""The manifest: one JSON document per (model, SKU), validated against a published schema.

Everything but the ``provenance`` block is a function of the stage reports, so the same inputs
give the same document; ``digest`` is the sha256 of the document without digest and provenance.
"""

from __future__ import annotations

import socket
import subprocess
from datetime import datetime, timezone
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from . import __version__
from .errors import InputError
from .io import read_json, sha256_json
from .results import Manifest, Provenance

SCHEMA_FILE = "manifest.schema.json"
_UNHASHED = ("digest", "provenance")


def schema() -> dict[str, Any]:
    """The JSON Schema of the manifest, generated from the typed model."""
    doc = Manifest.model_json_schema()
    doc["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    doc["$id"] = "https://skuforge.dev/schemas/manifest-4.json"
    return doc


@lru_cache(maxsize=1)
def published_schema() -> dict[str, Any]:
    return __import__("json").loads(resources.files("pipeline.schemas").joinpath(SCHEMA_FILE).read_text())


def digest(body: dict[str, Any]) -> str:
    return sha256_json({k: v for k, v in body.items() if k not in _UNHASHED})


def validate_document(doc: Any, where: str = "manifest") -> None:
    """Check a manifest against the published schema and its own digest."""
    import jsonschema

    try:
        jsonschema.validate(doc, published_schema())
    except jsonschema.ValidationError as exc:
        path = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise InputError(f"{where} does not match the manifest schema at {path}: {exc.message}",
                         hint="regenerate it with skuforge manifest") from None
    if doc["digest"] != digest(doc):
        raise InputError(f"{where}: digest does not match its content (edited by hand?)", hint="regenerate it with skuforge manifest")


def load_manifest(path: Path) -> Manifest:
    if not path.is_file():
        raise InputError(f"{path} does not exist", hint="run the manifest stage (dvc repro)")
    doc = read_json(path)
    validate_document(doc, str(path))
    return Manifest.model_validate(doc)


def provenance(root: Path) -> Provenance:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return Provenance(created=datetime.now(timezone.utc).isoformat(timespec="seconds"), host=socket.gethostname(),
                      git_commit=commit, skuforge_version=__version__)
