"""Signed provenance: what publish signs, what promotion accepts per alias, where keys come from,
and the ``release.signing`` config and ``skuforge keys`` command around them."""

from __future__ import annotations

import base64
import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import models
import pytest
from cli_helpers import assert_user_error, skuforge

from pipeline.core.errors import ConfigError, EnvironmentProblem
from pipeline.project.config import SigningSpec, load_registry, parse_registry
from pipeline.results.signing import (
    ENV_KEY_DIR,
    ENV_SIGNING_KEY,
    SigningKey,
    aliases_accepting,
    canonical_payload,
    generate_key_file,
    signing_key,
    verify,
    write_private_key,
)

REPO = Path(__file__).resolve().parents[1]

DIGEST = "ab" * 32
CI = SigningKey.generate("ci")
DEV = SigningKey.generate("dev")
ALIASES = ["candidate", "staging", "production"]


def spec(**trust) -> SigningSpec:
    return SigningSpec(
        keys={"ci": CI.public_key, "dev": DEV.public_key},
        trust=trust or {"candidate": ["*"], "staging": ["*", "dev"], "production": ["ci"]},
    )


def check(sig, alias="production", digest=DIGEST, model="m", sku="cpu", trust=None):
    return verify(sig, digest, model, sku, alias, trust or spec())


def refused(verdict, *words):
    assert not verdict.passed, verdict
    for word in words:
        assert word in verdict.detail, (word, verdict.detail)


# --- verification ---------------------------------------------------------------------------------


def test_roundtrip_through_json():
    sig = CI.sign(DIGEST, "m", "cpu")
    doc = json.loads(json.dumps(sig.to_json()))
    assert doc["algorithm"] == "ed25519" and doc["key_id"] == CI.key_id and doc["payload"]["digest"] == DIGEST
    for form in (sig, doc, json.dumps(doc)):
        verdict = check(form)
        assert verdict.passed and verdict.key_name == "ci" and verdict.key_id == CI.key_id, verdict


def test_payload_is_canonical():
    assert (
        canonical_payload(DIGEST, "m", "cpu")
        == ('{"digest":"' + DIGEST + '","model":"m","sku":"cpu","type":"skuforge-manifest","version":1}').encode()
    )
    assert CI.key_id.startswith("ed25519:") and len(CI.key_id) == len("ed25519:") + 16
    assert len(base64.b64decode(CI.public_key.removeprefix("ed25519:"))) == 32


@pytest.mark.parametrize("change", [{"digest": "cd" * 32}, {"model": "other"}, {"sku": "gpu"}])
def test_signature_for_another_manifest_is_refused(change):
    sig = CI.sign(DIGEST, "m", "cpu")
    expected = {"digest": DIGEST, "model": "m", "sku": "cpu", **change}
    field = next(iter(change))
    refused(check(sig, **expected), f"covers {field}", "changed after it was signed")


def test_payload_edited_to_match_is_refused():
    """Re-digesting by hand and editing the signature's payload to match: the bytes no longer verify."""
    doc = CI.sign(DIGEST, "m", "cpu").to_json()
    doc["payload"]["digest"] = "cd" * 32
    refused(check(doc, digest="cd" * 32), "does not verify")


def test_bit_flipped_signature_is_refused():
    doc = CI.sign(DIGEST, "m", "cpu").to_json()
    raw = bytearray(base64.b64decode(doc["signature"]))
    raw[10] ^= 0x01
    doc["signature"] = base64.b64encode(bytes(raw)).decode()
    refused(check(doc), "does not verify")
    doc["signature"] = "not base64!"
    refused(check(doc), "does not verify")


def test_untrusted_key_is_refused_even_if_it_verifies():
    stranger = SigningKey.generate()
    refused(check(stranger.sign(DIGEST, "m", "cpu")), stranger.key_id, "not list", "trusts only ci")


def test_swapped_public_key_is_refused():
    """A stranger's signature dressed up with the CI key's public key and id."""
    doc = SigningKey.generate().sign(DIGEST, "m", "cpu").to_json()
    doc.update(public_key=CI.public_key, key_id=CI.key_id)
    refused(check(doc), "does not verify")
    doc = SigningKey.generate().sign(DIGEST, "m", "cpu").to_json()
    doc["key_id"] = CI.key_id
    refused(check(doc), "key_id")


def test_trusted_for_staging_not_production():
    sig = DEV.sign(DIGEST, "m", "cpu")
    assert check(sig, alias="staging").key_name == "dev"
    refused(check(sig, alias="production"), "'dev'", "trusts only ci")
    assert aliases_accepting(spec(), ALIASES, DEV.public_key) == ["candidate", "staging"]
    assert aliases_accepting(spec(), ALIASES, CI.public_key) == ALIASES


def test_star_accepts_any_signer_for_integrity_only():
    stranger = SigningKey.generate()
    verdict = check(stranger.sign(DIGEST, "m", "cpu"), alias="candidate")
    assert verdict.passed and verdict.key_name is None and "integrity only" in verdict.detail
    assert check(CI.sign(DIGEST, "m", "cpu"), alias="candidate").key_name == "ci"
    refused(check(stranger.sign(DIGEST, "m", "cpu"), alias="candidate", digest="cd" * 32), "covers digest")


def test_alias_missing_from_trust_refuses():
    trust = spec(candidate=["*"])
    refused(check(CI.sign(DIGEST, "m", "cpu"), alias="production", trust=trust), "no entry for 'production'")


def test_unconfigured_project_accepts_any_valid_signature():
    verdict = check(SigningKey.generate().sign(DIGEST, "m", "cpu"), alias="production", trust=SigningSpec())
    assert verdict.passed and "integrity only" in verdict.detail
    refused(check(None, trust=SigningSpec()), "unsigned")


@pytest.mark.parametrize(
    "doc, words",
    [
        (None, ["unsigned"]),
        ({}, ["malformed"]),
        ("not json", ["malformed"]),
        ([1, 2], ["malformed"]),
        ({"garbage": True}, ["malformed"]),
        ({**CI.sign(DIGEST, "m", "cpu").to_json(), "algorithm": "rsa"}, ["unsupported signature algorithm 'rsa'"]),
        ({**CI.sign(DIGEST, "m", "cpu").to_json(), "public_key": "ed25519:AAAA"}, ["public key is malformed"]),
        (
            {
                **CI.sign(DIGEST, "m", "cpu").to_json(),
                "payload": {"type": "other", "version": 1, "digest": DIGEST, "model": "m", "sku": "cpu"},
            },
            ["malformed"],
        ),
    ],
)
def test_missing_or_garbage_signature_is_refused(doc, words):
    refused(check(doc), "m/cpu -> production", *words)


# --- keys -----------------------------------------------------------------------------------------


def test_env_key_pem_and_raw_base64(tmp_path):
    pem = CI.private_pem().decode()
    raw = base64.b64encode(CI._private.private_bytes_raw()).decode()
    for value in (pem, raw, pem.replace("\n", "\\n")):
        key = signing_key({ENV_SIGNING_KEY: value, ENV_KEY_DIR: str(tmp_path)})
        assert key.public_key == CI.public_key and key.source == f"env {ENV_SIGNING_KEY}"
    assert not list(tmp_path.iterdir()), "an env key makes no developer key"


@pytest.mark.parametrize(
    "value",
    [
        "s3cr3t-not-a-key",
        base64.b64encode(b"x" * 31).decode(),
        "-----BEGIN PRIVATE KEY-----\nc2VjcmV0LWJ5dGVz\n-----END PRIVATE KEY-----\n",
    ],
)
def test_malformed_env_key_names_the_variable_not_the_secret(value, tmp_path):
    with pytest.raises(EnvironmentProblem) as info:
        signing_key({ENV_SIGNING_KEY: value, ENV_KEY_DIR: str(tmp_path)})
    text = str(info.value)
    assert ENV_SIGNING_KEY in text and "hint" in text
    assert "s3cr3t" not in text and "c2VjcmV0" not in text and value.strip() not in text
    assert info.value.__cause__ is None


def test_env_key_of_another_algorithm(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pem = (
        ec.generate_private_key(ec.SECP256R1())
        .private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        .decode()
    )
    with pytest.raises(EnvironmentProblem, match="not ed25519"):
        signing_key({ENV_SIGNING_KEY: pem, ENV_KEY_DIR: str(tmp_path)})


def test_developer_key_made_once_0600_and_reused(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(ENV_SIGNING_KEY, raising=False)
    monkeypatch.setenv(ENV_KEY_DIR, str(tmp_path / "keys"))
    with caplog.at_level(logging.INFO, logger="pipeline.results.signing"):
        first = signing_key()
        second = signing_key()
    path = tmp_path / "keys" / "signing_key.pem"
    assert first.source == second.source == str(path)
    assert first.public_key == second.public_key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["signing_key.pem"], "no temporary file left"
    created = [r for r in caplog.records if "created a developer signing key" in r.getMessage()]
    assert len(created) == 1 and "skuforge keys show" in created[0].getMessage()
    assert "PRIVATE" not in caplog.text


def test_first_developer_key_written_wins(tmp_path):
    """Two processes making the first key at once: the second keeps and uses the first one's."""
    path = tmp_path / "signing_key.pem"
    assert write_private_key(path, CI, replace=False)
    assert not write_private_key(path, DEV, replace=False)
    assert signing_key({ENV_KEY_DIR: str(tmp_path)}).public_key == CI.public_key
    assert [p.name for p in tmp_path.iterdir()] == ["signing_key.pem"]


def test_malformed_developer_key_names_the_file(tmp_path):
    (tmp_path / "signing_key.pem").write_text("junk")
    with pytest.raises(EnvironmentProblem, match="signing_key.pem") as info:
        signing_key({ENV_KEY_DIR: str(tmp_path)})
    assert "delete it" in info.value.hint


def test_generate_key_file_0600_never_overwrites(tmp_path):
    out = tmp_path / "ci.pem"
    key = generate_key_file(out)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert signing_key({ENV_SIGNING_KEY: out.read_text()}).public_key == key.public_key
    with pytest.raises(ConfigError, match="exists"):
        generate_key_file(out)
    assert signing_key({ENV_SIGNING_KEY: out.read_text()}).public_key == key.public_key


def test_signing_key_repr_shows_no_material():
    assert repr(CI) == f"SigningKey({CI.key_id}, source='ci')"


# --- release.signing ------------------------------------------------------------------------------


def registry_with(signing: dict, aliases: list[str] | None = None):
    release = {"signing": signing, **({"aliases": aliases} if aliases else {})}
    doc = {
        "defaults": {},
        "examples": {},
        "models": {"m": models.conv_bn_spec()},
        "skus": {"cpu": models.ort_sku("fp32")},
        "release": release,
    }
    return parse_registry(doc)


def test_signing_config_parses():
    registry = registry_with({"keys": {"ci": CI.public_key}, "trust": {"production": ["ci"], "staging": ["*"]}})
    signing = registry.release.signing
    assert signing.keys == {"ci": CI.public_key} and signing.trust["production"] == ["ci"]
    assert registry_with({}).release.signing == SigningSpec()


@pytest.mark.parametrize(
    "signing, words",
    [
        ({"keys": {"ci": "ed25519:not base64!"}}, ["release.signing.keys", "keys.ci", "not valid base64"]),
        ({"keys": {"ci": "ed25519:" + base64.b64encode(b"x" * 31).decode()}}, ["keys.ci", "32 bytes", "31"]),
        ({"keys": {"ci": base64.b64encode(b"x" * 32).decode()}}, ["keys.ci", "ed25519:<base64"]),
        ({"keys": {"c/i": CI.public_key}}, ["'c/i' is not a key name"]),
        ({"keys": {"ci": CI.public_key}, "trust": {"prod": ["ci"]}}, ["signing.trust", "'prod'", "not in aliases"]),
        (
            {"keys": {"ci": CI.public_key}, "trust": {"production": ["cl"]}},
            ["trust.production", "unknown key 'cl'", "did you mean 'ci'", "known keys: ci"],
        ),
        ({"trust": {"production": ["ci"]}}, ["unknown key 'ci'", "add release.signing.keys"]),
        ({"trust": {"production": []}}, ["trusts no key"]),
        ({"keys": {}, "trusted": {}}, ["release.signing.trusted", "did you mean 'trust'"]),
    ],
)
def test_bad_signing_config(signing, words):
    with pytest.raises(ConfigError) as info:
        registry_with(signing)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_example_project_trusts_only_ci_for_production():
    signing = load_registry(REPO / "params.yaml").release.signing
    assert signing.trust["production"] == ["ci"] and signing.keys["ci"].startswith("ed25519:")


# --- skuforge keys --------------------------------------------------------------------------------


def cli_env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != ENV_SIGNING_KEY}
    return {**env, ENV_KEY_DIR: str(tmp_path / "keys"), **extra}


def test_keys_show_developer_key(tmp_path):
    models.write_project(
        tmp_path,
        {"m": models.conv_bn_spec()},
        {"cpu": models.ort_sku("fp32")},
        release={"signing": {"keys": {"ci": CI.public_key}, "trust": {"candidate": ["*"], "production": ["ci"]}}},
    )
    proc = skuforge("keys", "show", "--json", cwd=tmp_path, env=cli_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["source"] == str(tmp_path / "keys" / "signing_key.pem")
    assert data["params_line"] == f"release.signing.keys.dev: {data['public_key']}"
    assert data["trusted_for"] == ["candidate"]
    assert "created a developer signing key" in proc.stderr
    again = skuforge("keys", "show", cwd=tmp_path, env=cli_env(tmp_path))
    assert again.returncode == 0 and data["public_key"] in again.stdout and data["key_id"] in again.stdout
    assert "created" not in again.stderr


def test_keys_show_env_key(tmp_path):
    proc = skuforge("keys", "show", cwd=tmp_path, env=cli_env(tmp_path, **{ENV_SIGNING_KEY: CI.private_pem().decode()}))
    assert proc.returncode == 0, proc.stderr
    assert f"release.signing.keys.ci: {CI.public_key}" in proc.stdout and "env SKUFORGE_SIGNING_KEY" in proc.stdout
    assert "PRIVATE" not in proc.stdout + proc.stderr
    assert not (tmp_path / "keys").exists()


def test_keys_show_malformed_env_key(tmp_path):
    proc = skuforge("keys", "show", cwd=tmp_path, env=cli_env(tmp_path, **{ENV_SIGNING_KEY: "s3cr3t-value"}))
    assert_user_error(proc, 3, ENV_SIGNING_KEY)
    assert "s3cr3t" not in proc.stdout + proc.stderr


def test_keys_generate(tmp_path):
    out = tmp_path / "ci.pem"
    proc = skuforge("keys", "generate", "--out", str(out), "--json", cwd=tmp_path, env=cli_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert signing_key({ENV_SIGNING_KEY: out.read_text()}).public_key == data["public_key"]
    assert "PRIVATE" not in proc.stdout
    assert_user_error(skuforge("keys", "generate", "--out", str(out), cwd=tmp_path, env=cli_env(tmp_path)), 2, "exists")


def test_keys_parser_imports_no_crypto():
    code = (
        "import contextlib, io, sys\nfrom pipeline.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n        main(['keys', 'show', '--help'])\n    except SystemExit:\n        pass\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cryptography', 'pydantic')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
