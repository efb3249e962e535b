"""What leaves the process, and how it fails: no credential is ever printed, and every user or
environment error is one line with a hint and its documented exit code (2, 3 or 4), never a
traceback and exit 70.

The real ``skuforge`` runs in a subprocess wherever the condition can be made real here: a dead
port, a live `mlflow server`, a read-only folder (``chattr +i``: the tests run as root, whom
permissions do not stop), DVC's own lock held by another process, a DVC that dies of SIGKILL, a
build killed with -9. A full disk (ENOSPC) and a file over the size limit (EFBIG) cannot be made
safely on a shared machine: those raise the OSError from the OS call, in-process.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import models
import pytest
from cli_helpers import REPO, assert_user_error, skuforge
from registry_helpers import free_port, make_project, sku

from pipeline.cli import main
from pipeline.core import io as pio
from pipeline.core import redact as rd
from pipeline.core.io import atomic_dir, atomic_write_bytes
from pipeline.core.paths import Layout
from pipeline.ops.repro import dvc_failure

PASSWORD = "S3cr3t-pa55word"
TOKEN = "tok-9f8e7d6c5b4a"
BIN = Path(sys.executable).parent


def env(**extra: str) -> dict[str, str]:
    """The user's environment without a store of its own, plus ``extra``."""
    out = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_TRACKING_TOKEN")
    }
    out["DVC_NO_ANALYTICS"] = "1"
    out["PATH"] = os.pathsep.join([str(BIN), out.get("PATH", "")])
    return {**out, **extra}


def assert_no_secret(proc: subprocess.CompletedProcess, *secrets: str) -> None:
    out = proc.stdout + proc.stderr
    for secret in secrets:
        assert secret not in out, out


@pytest.fixture
def pair(tmp_path) -> Path:
    """A project whose pair conv/cpu is built, validated, benched and described by a manifest."""
    make_project(tmp_path, {"cpu": sku()})
    return tmp_path


@pytest.fixture
def two(tmp_path) -> Path:
    make_project(tmp_path, {"a": sku(), "b": sku()})
    return tmp_path


def chattr(path: Path, flag: str) -> None:
    subprocess.run(["chattr", flag, str(path)], check=True, capture_output=True)


@pytest.fixture
def immutable():
    """``immutable(path)``: make a folder or file read-only even for root (chattr +i); undone after."""
    done: list[Path] = []

    def make(path: Path) -> Path:
        if shutil.which("chattr") is None:
            pytest.skip("no chattr here: a read-only folder cannot be made for root")
        proc = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"chattr +i is not allowed here: {proc.stderr.strip()}")
        done.append(path)
        return path

    yield make
    for path in done:
        chattr(path, "-i")


# --- secrets ------------------------------------------------------------------------------------


def test_redact_masks_uri_userinfo_env_secrets_and_headers():
    e = {
        "MLFLOW_TRACKING_TOKEN": TOKEN,
        "MY_API_KEY": "k3y-value-1",
        "GPG_KEY": "A035C8C19219BA821ECEA86B64E628F8D684696D",
        "SHORT_TOKEN": "abc",
        "MLFLOW_TRACKING_URI": f"https://me:{PASSWORD}@mlflow.example.com",
    }
    text = (
        f"GET https://me:{PASSWORD}@mlflow.example.com/api failed; token {TOKEN} k3y-value-1; "
        f"postgresql://u:pw@db/x; Authorization: Bearer abc.def-ghi; url?token=zzz999&x=1; abc; "
        "key A035C8C19219BA821ECEA86B64E628F8D684696D"
    )
    out = rd.redact(text, e)
    for secret in (PASSWORD, TOKEN, "k3y-value-1", "me:", "u:pw", "abc.def-ghi", "zzz999"):
        assert secret not in out, out
    assert "https://***@mlflow.example.com/api" in out and "postgresql://***@db/x" in out
    assert "A035C8C19219BA821ECEA86B64E628F8D684696D" in out  # a public key fingerprint is no secret
    assert "; abc;" in out  # values under 6 characters would mask ordinary words
    assert rd.redact(out, e) == out
    assert rd.redact("sqlite:////tmp/mlflow.db and file:///x") == "sqlite:////tmp/mlflow.db and file:///x"


def test_everything_the_cli_prints_is_redacted(capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)

    def to_stderr(message, category, filename, lineno, file=None, line=None):  # not into pytest's summary
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    monkeypatch.setattr(warnings, "showwarning", to_stderr)
    before = (sys.stdout, sys.stderr, logging.getLogRecordFactory(), warnings.showwarning)
    installed = rd.install()
    try:
        logging.getLogger("urllib3.connectionpool").warning("Retrying http://u:%s@h/x", PASSWORD)
        logging.getLogger("mlflow.store").error("failed", exc_info=RuntimeError(f"token {TOKEN}"))
        with warnings.catch_warnings():
            warnings.simplefilter("always")  # shown again when the test runs twice
            warnings.warn(f"header Authorization: Bearer {TOKEN}", stacklevel=1)
        print(f"https://u:{PASSWORD}@h")
    finally:
        installed.undo()
    assert (sys.stdout, sys.stderr, logging.getLogRecordFactory(), warnings.showwarning) == before
    out, err = capsys.readouterr()
    assert PASSWORD not in out + err and TOKEN not in out + err, out + err
    assert "https://***@h" in out and "Bearer ***" in err


def test_a_bugs_traceback_is_redacted(pair, capsys, monkeypatch):
    from pipeline.cli import commands

    def boom(args):
        raise RuntimeError(f"cannot reach https://user:{PASSWORD}@mlflow.example.com")

    monkeypatch.setattr(commands, "summary", boom)
    assert main(["--params", str(pair / "params.yaml"), "summary"]) == 70
    err = capsys.readouterr().err
    assert "Traceback" in err and "internal error" in err and PASSWORD not in err, err
    assert "https://***@mlflow.example.com" in err


@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_password_in_uri_on_a_dead_port(pair, verbose):
    uri = f"http://ci-user:{PASSWORD}@127.0.0.1:{free_port()}"
    proc = skuforge(
        *(["-v"] if verbose else []),
        "publish",
        "--model",
        "conv",
        "--sku",
        "cpu",
        cwd=pair,
        env=env(MLFLOW_TRACKING_URI=uri),
    )
    assert_user_error(proc, 4, "127.0.0.1", "failed after 3 attempts")
    assert "retry 1 of 2" in proc.stderr  # the retry warnings carry MLflow's text: redacted too
    assert_no_secret(proc, PASSWORD, "ci-user")


def test_token_in_env_on_a_dead_port(pair):
    proc = skuforge(
        "-v",
        "publish",
        "--model",
        "conv",
        "--sku",
        "cpu",
        cwd=pair,
        env=env(MLFLOW_TRACKING_URI=f"http://127.0.0.1:{free_port()}", MLFLOW_TRACKING_TOKEN=TOKEN),
    )
    assert_user_error(proc, 4, "127.0.0.1")
    assert_no_secret(proc, TOKEN)


def test_token_and_password_with_a_live_server(pair, server):
    """The server requires nothing, but the client still sends the token and the basic credentials:
    publishing and promoting (verbose: every HTTP request logged) print neither."""
    uri = server.uri.replace("http://", f"http://ci-user:{PASSWORD}@")
    e = env(MLFLOW_TRACKING_URI=uri, MLFLOW_TRACKING_TOKEN=TOKEN)
    pub = skuforge("-v", "publish", "--model", "conv", "--sku", "cpu", cwd=pair, env=e)
    assert pub.returncode == 0, pub.stdout + pub.stderr
    assert "published conv/cpu" in pub.stdout and f"http://***@127.0.0.1:{server.port}" in pub.stdout
    assert_no_secret(pub, PASSWORD, TOKEN, "ci-user")
    promo = skuforge("-v", "promote", "--model", "conv", "--sku", "cpu", "--to", "candidate", cwd=pair, env=e)
    assert promo.returncode in (0, 1), promo.stdout + promo.stderr  # a gate may refuse; it must not leak
    assert "Traceback" not in promo.stdout + promo.stderr
    assert_no_secret(promo, PASSWORD, TOKEN, "ci-user")


# --- the store: what no retry heals -------------------------------------------------------------


def test_https_to_a_plain_http_server_is_not_retried(pair, server):
    uri = server.uri.replace("http://", f"https://ci-user:{PASSWORD}@")
    proc = skuforge("publish", "--model", "conv", "--sku", "cpu", cwd=pair, env=env(MLFLOW_TRACKING_URI=uri))
    assert_user_error(proc, 4, f"https://***@127.0.0.1:{server.port}", "SSL")
    assert "retry" not in proc.stderr
    assert_no_secret(proc, PASSWORD, "ci-user")


def test_unsupported_uri_scheme(pair):
    proc = skuforge("publish", "--model", "conv", "--sku", "cpu", cwd=pair, env=env(MLFLOW_TRACKING_URI="foo://x"))
    assert_user_error(proc, 2, "foo://", "MLFLOW_TRACKING_URI")
    assert "retry" not in proc.stderr


def test_missing_database_driver(pair):
    for module in ("psycopg", "psycopg2"):
        try:
            __import__(module)
        except ImportError:
            continue
        pytest.skip(f"{module} is installed here: no driver is missing")
    uri = f"postgresql://ci-user:{PASSWORD}@127.0.0.1:{free_port()}/mlflow"
    proc = skuforge("publish", "--model", "conv", "--sku", "cpu", cwd=pair, env=env(MLFLOW_TRACKING_URI=uri))
    assert_user_error(proc, 3, "psycopg", "not installed", "pip install")
    assert "retry" not in proc.stderr
    assert_no_secret(proc, PASSWORD, "ci-user")


def test_read_only_database_fails_at_once_in_one_line(two, immutable):
    first = skuforge("publish", "--model", "conv", "--sku", "a", cwd=two, env=env())
    assert first.returncode == 0, first.stderr
    db = immutable(two / "mlflow.db")
    proc = skuforge("publish", "--model", "conv", "--sku", "b", cwd=two, env=env())
    assert_user_error(proc, 3, str(db), "read-only", "writable")
    assert "retry" not in proc.stderr and proc.stderr.count("skuforge: error:") == 1
    assert "sqlite3.OperationalError" not in proc.stderr  # MLflow's own traceback log is held back


# --- malformed input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [("summary",), ("publish", "--all"), ("ci", "summary", "--sku", "cpu")],
    ids=["summary", "publish-all", "ci-summary"],
)
def test_non_json_manifest(pair, command):
    path = Layout(pair).manifest("conv", "cpu")
    path.write_text("{ this is not json")
    proc = skuforge(*command, cwd=pair, env=env(MLFLOW_TRACKING_URI=f"http://127.0.0.1:{free_port()}"))
    assert_user_error(proc, 2, str(path), "not valid JSON")
    assert path.read_text() == "{ this is not json"  # reported, not rewritten


def test_version_that_is_not_a_number(two):
    proc = skuforge(
        "promote", "--model", "conv", "--sku", "a", "--to", "candidate", "--version", "abc", cwd=two, env=env()
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "--version" in proc.stderr and "'abc' is not a version number" in proc.stderr, out
    assert "Traceback" not in out and not (two / "mlflow.db").exists()  # refused before any store is opened


# --- writes that fail ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "folder,command",
    [
        ("build/conv/cpu", ("build", "--model", "conv", "--sku", "cpu")),
        ("manifests/conv", ("manifest", "--model", "conv", "--sku", "cpu")),
    ],
    ids=["build", "manifests"],
)
def test_read_only_output_folder(pair, immutable, folder, command):
    before = {p: p.read_bytes() for p in (pair / folder).rglob("*") if p.is_file()}
    immutable(pair / folder)
    proc = skuforge(*command, cwd=pair, env=env())
    assert_user_error(proc, 3, str(pair / folder), "not writable", "make")
    assert {p: p.read_bytes() for p in (pair / folder).rglob("*") if p.is_file()} == before
    assert not list((pair / folder).glob(".*.tmp"))


def test_read_only_artifact_store(two, immutable):
    first = skuforge("publish", "--model", "conv", "--sku", "a", cwd=two, env=env())
    assert first.returncode == 0, first.stderr
    immutable(two / "mlartifacts")
    proc = skuforge("publish", "--model", "conv", "--sku", "b", cwd=two, env=env())
    assert_user_error(proc, 3, str(two / "mlartifacts"), "not writable")


def _raising(code: int):
    """A stand-in for an OS call that fails with ``code`` (what a full disk or a read-only mount answers)."""

    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    return fail


@pytest.mark.parametrize(
    "code,words",
    [
        (errno.ENOSPC, ("no space left", "free space")),
        (errno.EFBIG, ("larger than the file system", "ulimit -f")),
    ],
    ids=["ENOSPC", "EFBIG"],
)
def test_disk_full_or_file_too_large_keeps_the_old_manifest(pair, capsys, monkeypatch, code, words):
    # cannot be made for real on a shared disk: the write's fsync answers as a full disk would
    path = Layout(pair).manifest("conv", "cpu")
    old = path.read_bytes()
    monkeypatch.setattr(pio.os, "fsync", _raising(code))
    assert main(["--params", str(pair / "params.yaml"), "manifest", "--model", "conv", "--sku", "cpu"]) == 3
    err = capsys.readouterr().err
    assert f"skuforge: error: cannot write {path}" in err and "hint:" in err and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    assert path.read_bytes() == old and sorted(os.listdir(path.parent)) == ["cpu.json"]


def test_disk_full_while_building_keeps_the_old_engine(pair, capsys, monkeypatch):
    # the engine's files are written into the staging folder; the disk fills up there
    engine = Layout(pair).engine_dir("conv", "cpu")
    before = {p.name: p.read_bytes() for p in engine.iterdir()}
    monkeypatch.setattr(pio.os, "fsync", _raising(errno.ENOSPC))
    code = main(["--params", str(pair / "params.yaml"), "build", "--model", "conv", "--sku", "cpu"])
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert code == 3, err
    assert f"cannot write {engine / 'engine.json'}: no space left" in err and "Traceback" not in err, err
    assert {p.name: p.read_bytes() for p in engine.iterdir()} == before
    assert not [p for p in engine.parent.iterdir() if p.name.startswith(".engine.")]


def test_read_only_file_system(pair, capsys, monkeypatch):
    # EROFS needs a read-only mount, which a test cannot make: mkstemp answers as one would
    path = Layout(pair).manifest("conv", "cpu")
    old = path.read_bytes()
    monkeypatch.setattr(pio.tempfile, "mkstemp", _raising(errno.EROFS))
    code = main(["--params", str(pair / "params.yaml"), "manifest", "--model", "conv", "--sku", "cpu"])
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert code == 3, err
    assert f"{path.parent} is not writable" in err and "Read-only file system" in err and "Traceback" not in err, err
    assert path.read_bytes() == old


# --- DVC ----------------------------------------------------------------------------------------


def dvc_project(root: Path) -> Path:
    subprocess.run(["git", "init", "-q"], cwd=root, check=True, env=env())
    shutil.copyfile(REPO / "dvc.yaml", root / "dvc.yaml")
    subprocess.run([str(BIN / "dvc"), "init", "-q"], cwd=root, check=True, env=env())
    models.conv_bn_model(root / "models/conv/model.onnx")
    models.write_project(root, {"conv": models.conv_bn_spec()}, {"cpu": models.ort_sku()})
    return root


HOLD_LOCK = """
import sys, time
from dvc.lock import Lock
lock = Lock(sys.argv[1])
lock.lock()
print("locked", flush=True)
time.sleep(120)
"""


def test_dvc_lock_held_by_another_process(tmp_path):
    root = dvc_project(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(root / ".dvc/tmp/lock")], cwd=root, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        proc = skuforge("repro", "--no-publish", cwd=root, env=env())
    finally:
        holder.kill()
        holder.wait()
    assert_user_error(proc, 3, "another dvc process is running", f"pid {holder.pid}", ".dvc/tmp/lock", "wait for it")
    assert "dvc.yaml" not in proc.stderr.split("skuforge: error:")[1]


def test_dvc_killed_by_a_signal(tmp_path):
    root = dvc_project(tmp_path)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "dvc").write_text('#!/bin/sh\necho "dvc $*" >&2\nkill -9 $$\n')  # dies as under the OOM killer
    (fake / "dvc").chmod(0o755)
    e = env()
    e["PATH"] = os.pathsep.join([str(fake), e["PATH"]])
    proc = skuforge("repro", "--no-publish", cwd=root, env=e)
    assert_user_error(proc, 3, "killed by SIGKILL", "run `skuforge repro` again")
    assert "dvc.yaml" not in proc.stderr.split("skuforge: error:")[1]  # not blamed on a pipeline file
    # whatever dvc did, the matrix of what the records say still follows
    assert proc.stdout.splitlines()[0].split()[:3] == ["model", "sku", "outcome"], proc.stdout


def test_dvc_failures_are_told_apart(tmp_path):
    killed_stage = dvc_failure(
        tmp_path,
        255,
        "ERROR: failed to reproduce 'build@m-cpu': failed to run: "
        "skuforge build --model m --sku cpu, exited with 137\n",
    )
    assert killed_stage.exit_code == 3 and "SIGKILL" in killed_stage.message and killed_stage.stage_failed
    crashed = dvc_failure(tmp_path, 255, "ERROR: failed to run: skuforge bench --model m --sku cpu, exited with -6\n")
    assert crashed.exit_code == 70 and "crashed (SIGABRT" in crashed.message and "from outside" not in crashed.hint
    assert crashed.stage_failed  # its outcome is the matrix's, not 'run again'
    stage = dvc_failure(tmp_path, 255, "ERROR: failed to reproduce 'build@m-cpu': failed to run: x, exited with 3\n")
    assert stage.exit_code == 3 and "SIGKILL" not in stage.message
    refused = dvc_failure(tmp_path, 255, "ERROR: unknown stage 'x'\n")
    assert refused.exit_code == 2 and "dvc.yaml" in refused.hint
    silent = dvc_failure(tmp_path, 1, f"Traceback ... https://u:{PASSWORD}@h\nImportError: no module named x\n")
    assert silent.exit_code == 3 and "ImportError" in silent.message
    rwlock = dvc_failure(tmp_path, 255, "ERROR: 'build/x' is busy, it is being blocked by:\n  (PID 4242): dvc repro\n")
    assert rwlock.exit_code == 3 and "pid 4242: dvc repro" in rwlock.message and "rwlock" in rwlock.message


# --- stale temporary folders --------------------------------------------------------------------


HOLD_STAGING = """
import sys, time
from pipeline.core.io import atomic_dir
with atomic_dir(sys.argv[1]) as staging:
    (staging / "model.bin").write_bytes(b"half an engine")
    print(staging, flush=True)
    time.sleep(120)
"""


def test_a_build_killed_with_sigkill_leaves_nothing_the_next_build_keeps(pair):
    engine = Layout(pair).engine_dir("conv", "cpu")
    writer = subprocess.Popen(
        [sys.executable, "-c", HOLD_STAGING, str(engine)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    staging = Path(writer.stdout.readline().strip())
    assert staging.is_dir() and f".engine.{writer.pid}." in staging.name
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert staging.is_dir()  # kill -9 runs no clean-up
    proc = skuforge("build", "--model", "conv", "--sku", "cpu", cwd=pair, env=env())
    assert proc.returncode == 0, proc.stderr
    assert not staging.exists() and (engine / "engine.json").is_file()
    assert [p.name for p in engine.parent.iterdir() if p.name.startswith(".engine")] == []


def test_stale_temporaries_are_removed_and_live_ones_kept(tmp_path):
    target = tmp_path / "engine"
    target.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f".engine.{dead.pid}.abc123.tmp"  # its writer is gone
    legacy = tmp_path / ".engine.xyz789.tmp"  # an old name without a pid, hours old
    recent_legacy = tmp_path / ".engine.qrs456.tmp"  # without a pid but new: maybe another writer's
    live = tmp_path / f".engine.{os.getppid()}.def456.tmp"  # a live process's (our parent's)
    old = tmp_path / ".engine.old"  # a finished swap killed before its clean-up
    for d in (orphan, legacy, recent_legacy, live, old):
        d.mkdir()
        (d / "x").write_bytes(b"x")
    hours_ago = time.time() - 2 * pio.STALE_SECONDS
    os.utime(legacy, (hours_ago, hours_ago))
    file_orphan = tmp_path / f".r.json.{dead.pid}.aaa.tmp"
    file_orphan.write_bytes(b"{")
    with atomic_dir(target) as staging:
        (staging / "new").write_bytes(b"new")
    atomic_write_bytes(tmp_path / "r.json", b"{}")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["engine", "r.json", recent_legacy.name, live.name]), left
    assert (target / "new").read_bytes() == b"new"


def test_a_swap_killed_half_way_is_undone(tmp_path):
    target = tmp_path / "engine"
    old = tmp_path / ".engine.old"  # the old engine moved aside, the new one never moved in
    old.mkdir()
    (old / "old.bin").write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_dir(target):
        assert (target / "old.bin").read_bytes() == b"old"  # the last good engine is back
        raise RuntimeError("the new build fails")
    assert (target / "old.bin").read_bytes() == b"old" and not old.exists()


def test_read_json_names_a_malformed_file(tmp_path):
    from pipeline.core.errors import MalformedFile
    from pipeline.core.io import read_json

    bad = tmp_path / "r.json"
    bad.write_bytes(b'{"a": 1,')
    with pytest.raises(MalformedFile, match=str(bad)) as info:
        read_json(bad)
    assert info.value.exit_code == 2 and isinstance(info.value, ValueError)
    bad.write_bytes(b"\xff\xfe{}")
    with pytest.raises(MalformedFile, match="not UTF-8"):
        read_json(bad)
