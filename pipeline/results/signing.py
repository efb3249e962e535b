"""Signed provenance: who published a manifest, and which aliases trust them.

Publish signs the manifest digest, bound to the model and SKU, with an ed25519 key; promotion
verifies the signature against the keys ``release.signing`` in params.yaml trusts for the target
alias. A manifest edited and re-digested by hand no longer matches its signature, and one re-signed
with a key of one's own reaches only the aliases that accept any signer (``"*"``).

Keys and verification live here and nowhere else. ``cryptography`` is imported inside the functions
that need it, so the config code can validate public keys without loading it.

Trust rule (``trusted_for``): an alias accepts the key names ``release.signing.trust.<alias>`` lists;
``"*"`` accepts any signature that verifies, whoever signed (integrity only: it proves the manifest
was not altered after it was signed, not who signed it). An alias missing from ``trust`` refuses
everything, except in a project with no ``trust`` at all, where every alias accepts ``"*"``.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from pipeline.core.env import SKUFORGE_KEY_DIR, SKUFORGE_SIGNING_KEY, XDG_CONFIG_HOME
from pipeline.core.errors import ConfigError, EnvironmentProblem

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from pipeline.project.config import SigningSpec

log = logging.getLogger(__name__)

ENV_SIGNING_KEY = SKUFORGE_SIGNING_KEY.name
"""The publishing key (a CI secret): ed25519 private key as PEM PKCS8 text, or base64 of its 32 raw bytes."""
ENV_KEY_DIR = SKUFORGE_KEY_DIR.name
"""Folder of the developer key ``signing_key.pem``, made on first use (default ``~/.config/skuforge``)."""

ALGORITHM: Final = "ed25519"
PUBLIC_PREFIX = "ed25519:"
ANY_SIGNER = "*"
DEV_KEY_FILE = "signing_key.pem"
PAYLOAD_TYPE: Final = "skuforge-manifest"
PAYLOAD_VERSION: Final = 1


# --- public keys as text --------------------------------------------------------------------------


def parse_public_key(text: str) -> bytes:
    """The 32 raw bytes of ``ed25519:<base64>``; ValueError saying what is wrong."""
    if not isinstance(text, str) or not text.startswith(PUBLIC_PREFIX):
        raise ValueError(f"a public key reads '{PUBLIC_PREFIX}<base64 of 32 bytes>' (`skuforge keys show` prints it)")
    try:
        raw = base64.b64decode(text[len(PUBLIC_PREFIX) :], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the part after 'ed25519:' is not valid base64") from None
    if len(raw) != 32:
        raise ValueError(f"an ed25519 public key is 32 bytes, this one decodes to {len(raw)}")
    return raw


def format_public_key(raw: bytes) -> str:
    return PUBLIC_PREFIX + base64.b64encode(raw).decode("ascii")


def key_id(raw_public: bytes) -> str:
    """Short stable name of a public key: ``ed25519:`` and 16 hex digits of its SHA-256."""
    return PUBLIC_PREFIX + hashlib.sha256(raw_public).hexdigest()[:16]


# --- what is signed -------------------------------------------------------------------------------


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class Payload(_Doc):
    """What a signature covers: the manifest digest bound to its model and SKU."""

    type: Literal["skuforge-manifest"] = PAYLOAD_TYPE
    version: Literal[1] = PAYLOAD_VERSION
    digest: str
    model: str
    sku: str

    def canonical(self) -> bytes:
        return canonical_payload(self.digest, self.model, self.sku)


def canonical_payload(digest: str, model: str, sku: str) -> bytes:
    """The exact bytes signed: compact JSON with sorted keys."""
    doc = {"type": PAYLOAD_TYPE, "version": PAYLOAD_VERSION, "digest": digest, "model": model, "sku": sku}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")


class Signature(_Doc):
    """A detached signature of one manifest, stored beside it (JSON form: ``to_json``/``from_json``)."""

    algorithm: Literal["ed25519"] = ALGORITHM
    key_id: str
    public_key: str
    signature: str
    payload: Payload

    @classmethod
    def from_json(cls, doc: Any) -> Signature:
        """From a dict or JSON text; ValueError on anything else."""
        if isinstance(doc, (str, bytes)):
            doc = json.loads(doc)
        return cls.model_validate(doc)


@dataclass(frozen=True)
class Verdict:
    passed: bool
    key_name: str | None
    detail: str
    key_id: str | None = None

    def __bool__(self) -> bool:
        return self.passed


# --- private keys ---------------------------------------------------------------------------------


def _ed25519():
    from cryptography.hazmat.primitives.asymmetric import ed25519

    return ed25519


class SigningKey:
    """An ed25519 private key and where it came from. Never prints key material."""

    def __init__(self, private: Ed25519PrivateKey, source: str):
        from cryptography.hazmat.primitives import serialization

        self._private = private
        self.source = source
        self.public_bytes = private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @classmethod
    def generate(cls, source: str = "generated") -> SigningKey:
        return cls(_ed25519().Ed25519PrivateKey.generate(), source)

    @property
    def key_id(self) -> str:
        return key_id(self.public_bytes)

    @property
    def public_key(self) -> str:
        return format_public_key(self.public_bytes)

    def sign(self, digest: str, model: str, sku: str) -> Signature:
        raw = self._private.sign(canonical_payload(digest, model, sku))
        return Signature(
            key_id=self.key_id,
            public_key=self.public_key,
            signature=base64.b64encode(raw).decode("ascii"),
            payload=Payload(digest=digest, model=model, sku=sku),
        )

    def sign_bytes(self, data: bytes) -> bytes:
        """The raw ed25519 signature of ``data`` (device reports, pipeline/rollout/identity.py)."""
        return self._private.sign(data)

    def tuf_signer(self):
        """This key as a securesystemslib signer for TUF metadata (pipeline/rollout/trust.py)."""
        from securesystemslib.signer import CryptoSigner, SSlibKey

        return CryptoSigner(self._private, SSlibKey.from_crypto(self._private.public_key()))

    def private_pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return self._private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def __repr__(self) -> str:
        return f"SigningKey({self.key_id}, source={self.source!r})"


def _load_private(data: bytes, where: str, hint: str) -> Ed25519PrivateKey:
    """A PEM PKCS8 key or base64 of the 32 raw bytes. Errors name ``where``, never the bytes."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    ed25519 = _ed25519()
    text = data.strip()
    if text.startswith(b"-----BEGIN"):
        if b"\n" not in text and b"\\n" in text:  # a secret pasted with escaped newlines
            text = text.replace(b"\\n", b"\n")
        try:
            key = serialization.load_pem_private_key(text + b"\n", password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm):
            # from None: the parser's message could quote the key
            raise EnvironmentProblem(f"{where}: not a readable unencrypted PEM private key", hint=hint) from None
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise EnvironmentProblem(f"{where}: a {type(key).__name__.removeprefix('_')} key, not ed25519", hint=hint)
        return key
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise EnvironmentProblem(f"{where}: neither PEM nor base64", hint=hint) from None
    if len(raw) != 32:
        raise EnvironmentProblem(f"{where}: base64 of {len(raw)} bytes, an ed25519 private key is 32", hint=hint)
    return ed25519.Ed25519PrivateKey.from_private_bytes(raw)


def key_dir(env: Mapping[str, str] | None = None) -> Path:
    """``SKUFORGE_KEY_DIR``, else ``$XDG_CONFIG_HOME/skuforge``, else ``~/.config/skuforge``; ``env``:
    the environment to read (default: this process's)."""
    configured = SKUFORGE_KEY_DIR.get(env)
    if configured:
        return configured
    return (XDG_CONFIG_HOME.get(env) or Path.home() / ".config").expanduser() / "skuforge"


def signing_key(env: Mapping[str, str] | None = None) -> SigningKey:
    """The publishing key: ``SKUFORGE_SIGNING_KEY`` if set, else the developer key (made on first use)."""
    value = SKUFORGE_SIGNING_KEY.get(env)
    if value:
        where = f"environment variable {ENV_SIGNING_KEY}"
        private = _load_private(
            value.encode(),
            where,
            hint="set it to an ed25519 private key (PEM, from `skuforge keys generate`) or unset it",
        )
        return SigningKey(private, f"env {ENV_SIGNING_KEY}")
    return _developer_key(key_dir(env) / DEV_KEY_FILE)


def _developer_key(path: Path) -> SigningKey:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return _create_developer_key(path)
    except OSError as exc:
        raise EnvironmentProblem(
            f"cannot read the developer signing key {path}: {exc.strerror}",
            hint=f"fix its permissions, or set {ENV_KEY_DIR} to another folder",
        ) from exc
    if path.stat().st_mode & 0o077:
        log.warning("the developer signing key %s is readable by others: chmod 600 it", path)
    private = _load_private(
        data,
        f"developer signing key {path}",
        hint=f"delete it to have a new one made (versions it signed will need re-publishing), "
        f"or set {ENV_KEY_DIR} to another folder",
    )
    return SigningKey(private, str(path))


def _create_developer_key(path: Path) -> SigningKey:
    key = SigningKey.generate(str(path))
    try:
        created = write_private_key(path, key, replace=False)
    except OSError as exc:
        raise EnvironmentProblem(
            f"cannot write a developer signing key to {path}: {exc.strerror}",
            hint=f"set {ENV_KEY_DIR} to a writable folder, or {ENV_SIGNING_KEY} to a key",
        ) from exc
    if not created:  # another process made it first: use theirs
        return _developer_key(path)
    log.info(
        "created a developer signing key %s at %s; versions it signs reach only the aliases whose "
        "release.signing.trust lists '*' or this key (`skuforge keys show` prints the line for params.yaml)",
        key.key_id,
        path,
    )
    return key


def write_private_key(path: str | os.PathLike, key: SigningKey, replace: bool = True) -> bool:
    """Write ``key`` as PEM, mode 0600, atomically. With ``replace=False`` an existing file wins
    (returns False) so two processes making the first key agree on one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mkstemp: 0600
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(key.private_pem())
            fh.flush()
            os.fsync(fh.fileno())
        if replace:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)  # unlike rename, never clobbers
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links
            if path.exists():
                return False
            os.replace(tmp, path)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def read_key_file(path: str | os.PathLike) -> SigningKey:
    """A private key from a file (PEM, or base64 of the 32 raw bytes), e.g. an offline root key."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the key file {path}: {exc.strerror}", hint="check the path") from exc
    return SigningKey(
        _load_private(
            data,
            f"key file {path}",
            hint="give an ed25519 private key file (`skuforge keys generate --out FILE` writes one)",
        ),
        str(path),
    )


def generate_key_file(path: str | os.PathLike) -> SigningKey:
    """A new private key written to ``path`` (0600), e.g. to store as the CI secret."""
    path = Path(path)
    key = SigningKey.generate(str(path))
    try:
        if not write_private_key(path, key, replace=False):
            raise ConfigError(f"{path} exists: not overwriting a key", hint="choose another --out, or delete it first")
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror}", hint="choose another --out") from exc
    return key


# --- verification ---------------------------------------------------------------------------------


def trusted_for(spec: SigningSpec, alias: str) -> tuple[str, ...]:
    """Key names (or ``"*"``) an alias accepts. See the module docstring for the rule."""
    if not spec.trust:
        return (ANY_SIGNER,)
    return tuple(spec.trust.get(alias, ()))


def key_names(spec: SigningSpec, public_key: str) -> list[str]:
    """Names under ``release.signing.keys`` whose key is ``public_key`` (compared as raw bytes)."""
    try:
        raw = parse_public_key(public_key)
    except ValueError:
        return []
    return [name for name, listed in spec.keys.items() if parse_public_key(listed) == raw]


def aliases_accepting(spec: SigningSpec, aliases: list[str], public_key: str) -> list[str]:
    """The aliases a version signed with ``public_key`` may reach."""
    names = set(key_names(spec, public_key))
    return [a for a in aliases if ANY_SIGNER in trusted_for(spec, a) or names & set(trusted_for(spec, a))]


def verify(
    sig: Signature | dict | str | None, digest: str, model: str, sku: str, alias: str, trust: SigningSpec
) -> Verdict:
    """May a manifest with this digest, model and SKU, signed by ``sig``, hold ``alias``? Fails closed."""

    def refuse(detail: str, kid: str | None = None, name: str | None = None) -> Verdict:
        return Verdict(False, name, f"{model}/{sku} -> {alias}: {detail}", kid)

    if sig is None:
        return refuse("the manifest is unsigned (publish signs it; re-publish this version)")
    if isinstance(sig, dict) and sig.get("algorithm", ALGORITHM) != ALGORITHM:
        return refuse(f"unsupported signature algorithm {str(sig['algorithm'])[:40]!r} (only {ALGORITHM})")
    if not isinstance(sig, Signature):
        try:
            sig = Signature.from_json(sig)
        except (ValidationError, ValueError, TypeError) as exc:
            return refuse(f"the signature document is malformed: {_short(exc)}")

    expected = {"digest": digest, "model": model, "sku": sku}
    for field, want in expected.items():
        got = getattr(sig.payload, field)
        if got != want:
            return refuse(
                f"the signature covers {field} {got!r}, the manifest has {want!r} "
                "(the manifest was changed after it was signed)",
                sig.key_id,
            )
    try:
        carried = parse_public_key(sig.public_key)
    except ValueError as exc:
        return refuse(f"the signature's public key is malformed: {exc}", sig.key_id)
    if key_id(carried) != sig.key_id:
        return refuse(f"key_id {sig.key_id[:40]!r} does not belong to the signature's public key", sig.key_id)

    kid = sig.key_id
    names = key_names(trust, sig.public_key)
    accepted = trusted_for(trust, alias)
    trusted = [n for n in names if n in accepted]
    name = trusted[0] if trusted else (names[0] if names else None)
    # Verified with the listed key's bytes when one matches; the carried key serves "*" only.
    verify_with = parse_public_key(trust.keys[name]) if name else carried
    if not _signature_valid(verify_with, sig.signature, canonical_payload(digest, model, sku)):
        return refuse("the signature does not verify (the manifest or its signature was altered)", kid, name)
    if trusted:
        return Verdict(True, name, f"{model}/{sku} -> {alias}: signed by trusted key {name!r} ({kid})", kid)
    if ANY_SIGNER in accepted:
        who = f"key {name!r}" if name else "an unlisted key"
        return Verdict(
            True,
            name,
            f"{model}/{sku} -> {alias}: signed by {who} ({kid}); '{alias}' accepts any signer (integrity only)",
            kid,
        )
    who = f"key {name!r} ({kid})" if name else f"key {kid}, which release.signing.keys does not list"
    if accepted:
        return refuse(f"signed by {who}; '{alias}' trusts only {', '.join(accepted)}", kid, name)
    return refuse(f"signed by {who}; release.signing.trust has no entry for '{alias}', so it trusts no key", kid, name)


def _signature_valid(raw_public: bytes, signature_b64: str, payload: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature

    try:
        raw_sig = base64.b64decode(signature_b64, validate=True)
    except (binascii.Error, ValueError):
        return False
    try:
        _ed25519().Ed25519PublicKey.from_public_bytes(raw_public).verify(raw_sig, payload)
    except (InvalidSignature, ValueError):
        return False
    return True


def _short(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(top level)'}: {e['msg']}" for e in exc.errors()[:3])
    return str(exc)[:200]
