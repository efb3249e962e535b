"""Device identity: each device signs its health reports with a key made at provisioning.

A device's ed25519 key lives in its agent folder (``identity/device_key.pem``, mode 0600, made on
the first run or by ``skuforge agent identity``); its public half (``ed25519:<base64>``) goes into the
fleet inventory's ``key`` column, which is reviewed like params.yaml. The controller counts a report
only when it verifies under the key the inventory gives the device id it claims, so whoever can
write ``reports/`` in the store can delete reports but not forge or move them.

A signed report is the JSON document ``{"report": {...}, "signature": {"key_id", "signature"}}``;
the signature covers the canonical bytes of ``report`` (compact JSON, sorted keys, ASCII).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from pathlib import Path
from typing import Any

from pipeline.core.errors import ConfigError
from pipeline.results.signing import SigningKey, key_id, parse_public_key, read_key_file

KEY_FILE = "identity/device_key.pem"
REPORT_TYPE = "skuforge-device-report"
MAX_REPORT_BYTES = 64 * 1024  # a report is ~1 KB; anything far larger is not one


def canonical(report: dict[str, Any]) -> bytes:
    """The exact bytes a device signs."""
    return json.dumps(report, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def device_key(state_dir: str | os.PathLike, create: bool = True) -> SigningKey:
    """The device's private key from its agent folder, made (0600, atomically) when absent."""
    path = Path(state_dir) / KEY_FILE
    if path.is_file():
        return read_key_file(path)
    if not create:
        raise ConfigError(
            f"no device key in {path.parent}",
            hint="run `skuforge agent identity --state DIR` at provisioning and put the key it prints in the inventory",
        )
    key = SigningKey.generate(source=str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(key.private_pem())
            fh.flush()
            os.fsync(fh.fileno())
        os.link(tmp, path)  # never replaces a key another process made meanwhile
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return read_key_file(path)


def sign_report(key: SigningKey, report: dict[str, Any]) -> bytes:
    """The stored form of a report: the body and the device's signature over its canonical bytes."""
    body = dict(report, type=REPORT_TYPE)
    sig = key.sign_bytes(canonical(body))
    doc = {"report": body, "signature": {"key_id": key.key_id, "signature": base64.b64encode(sig).decode("ascii")}}
    return json.dumps(doc, sort_keys=True).encode("utf-8")


class BadReport(ValueError):
    """A report that is not counted; the message says why (listed by the controller)."""


def open_report(data: bytes, public_key: str | None) -> dict[str, Any]:
    """The report body of ``data`` when it is a well-formed report signed by ``public_key``;
    BadReport naming what is wrong otherwise."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if len(data) > MAX_REPORT_BYTES:
        raise BadReport(f"larger than {MAX_REPORT_BYTES // 1024} KB: not a report")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise BadReport("not JSON") from None
    if (
        not isinstance(doc, dict)
        or not isinstance(doc.get("report"), dict)
        or not isinstance(doc.get("signature"), dict)
    ):
        raise BadReport("not a signed report ({report, signature})")
    body, sig = doc["report"], doc["signature"]
    if body.get("type") != REPORT_TYPE:
        raise BadReport("not a device report")
    if not public_key:
        raise BadReport("the inventory has no key for this device")
    try:
        raw = parse_public_key(public_key)
        signature = base64.b64decode(str(sig.get("signature", "")), validate=True)
    except (ValueError, binascii.Error):
        raise BadReport("unreadable signature, or an unreadable key in the inventory") from None
    if sig.get("key_id") != key_id(raw):
        raise BadReport("signed by another key than the inventory's")
    try:
        Ed25519PublicKey.from_public_bytes(raw).verify(signature, canonical(body))
    except InvalidSignature:
        raise BadReport("bad signature") from None
    return body
