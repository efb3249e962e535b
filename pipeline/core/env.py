"""Every environment variable skuforge reads, declared once: name, type, default and one line of doc.

Read a variable through its declaration: ``SKUFORGE_REQUIRE_CACHE.get()`` parses and checks the
value, and a value that does not parse (``SKUFORGE_REQUIRE_CACHE=maybe``, ``AWS_MAX_ATTEMPTS=three``)
is a :class:`ConfigError` (exit 2) naming the variable; a secret's value is never put in the message.
Each accessor reads the environment when it is called (so ``monkeypatch.setenv`` and subprocesses
work) and takes an optional ``environ`` mapping in its place (functions that take ``env`` for their
tests pass it on).

An unset variable gives its default. So does a set but blank one, except a text variable: its
empty value is a value (``SKUFORGE_FAKE_CPU_FLAGS=""`` fakes a CPU without flags). Booleans accept
``1 true yes on`` and ``0 false no off`` in any case.

Nothing else in pipeline/ touches ``os.environ`` (tests/test_env.py checks it): reading, setting or
passing on a variable goes through its declaration here, and what takes the whole environment
(redaction scans it, child processes inherit it) goes through :func:`process_environment`.

Variables another tool defines (MLflow, the AWS SDK, CI systems, OpenMP) are declared with their
``owner``: skuforge reads them, or sets them where the user did not. The table of docs/cli.md is
generated from these declarations: ``python -m pipeline.core.env --markdown`` prints it,
``python -m pipeline.core.env --write docs/cli.md`` rewrites it in place.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Generic, TypeVar

from pipeline.core.errors import ConfigError

T = TypeVar("T")

SKUFORGE = "skuforge"
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def process_environment() -> Mapping[str, str]:
    """This process's environment, whole: for what scans it (redaction) or hands it to a child process."""
    return os.environ


def _writable(environ: MutableMapping[str, str] | None) -> MutableMapping[str, str]:
    return os.environ if environ is None else environ


@dataclass(frozen=True)
class Var(Generic[T]):
    """One environment variable. ``default_doc``: the default as the table shows it, where the code
    computes it (a path under another variable); ``owner``: the tool that defines the variable."""

    name: str
    doc: str
    default: T | None = None
    default_doc: str | None = None
    owner: str = SKUFORGE
    secret: bool = False

    kind: ClassVar[str] = "text"
    expects: ClassVar[str] = "text"

    @property
    def external(self) -> bool:
        return self.owner != SKUFORGE

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The value as set, unparsed (an empty string included); None when unset."""
        return (os.environ if environ is None else environ).get(self.name)

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        """Whether the variable is in the environment at all (even empty)."""
        return self.raw(environ) is not None

    def get(self, environ: Mapping[str, str] | None = None) -> T | None:
        """The parsed value; the default when unset or blank; a ConfigError when it does not parse."""
        text = self.raw(environ)
        if text is None or not text.strip():
            return self.default
        try:
            return self.parse(text)
        except ValueError as exc:
            raise self.malformed(text, str(exc)) from None

    def parse(self, text: str) -> T:
        raise NotImplementedError

    def malformed(self, text: str, why: str = "") -> ConfigError:
        why = f": {why}" if why else ""
        value = f"{self.name} (its value is secret: not shown)" if self.secret else f"{self.name}={text!r}"
        return ConfigError(
            f"environment variable {value} is not {self.expects}{why}",
            hint=f"fix or unset {self.name} ({self.doc})",
        )

    def set(self, value: str, environ: MutableMapping[str, str] | None = None) -> None:
        _writable(environ)[self.name] = value

    def setdefault(self, value: str, environ: MutableMapping[str, str] | None = None) -> str:
        """Set ``value`` unless the variable is set (the user's value wins); returns the value in effect."""
        return _writable(environ).setdefault(self.name, value)

    def unset(self, environ: MutableMapping[str, str] | None = None) -> None:
        _writable(environ).pop(self.name, None)

    def default_text(self) -> str:
        if self.default_doc is not None:
            return self.default_doc
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return f"`{str(self.default).lower()}`"
        return f"`{self.default}`"


@dataclass(frozen=True)
class Text(Var[str]):
    """Any text; an empty value is a value (not the default)."""

    def get(self, environ: Mapping[str, str] | None = None) -> str | None:
        text = self.raw(environ)
        return self.default if text is None else text

    def parse(self, text: str) -> str:
        return text


@dataclass(frozen=True)
class Flag(Var[bool]):
    default: bool | None = False
    kind: ClassVar[str] = "boolean"
    expects: ClassVar[str] = f"a boolean ({'/'.join(TRUE)} or {'/'.join(FALSE)})"

    def get(self, environ: Mapping[str, str] | None = None) -> bool:
        return bool(super().get(environ))

    def parse(self, text: str) -> bool:
        word = text.strip().lower()
        if word in TRUE:
            return True
        if word in FALSE:
            return False
        raise ValueError("")


@dataclass(frozen=True)
class Integer(Var[int]):
    minimum: int | None = None
    kind: ClassVar[str] = "integer"
    expects: ClassVar[str] = "an integer"

    def parse(self, text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError("") from None
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"the least is {self.minimum}")
        return value


@dataclass(frozen=True)
class Number(Var[float]):
    minimum: float | None = None
    kind: ClassVar[str] = "number"
    expects: ClassVar[str] = "a finite number"

    def parse(self, text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise ValueError("") from None
        if not math.isfinite(value):
            raise ValueError("")
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"the least is {self.minimum:g}")
        return value


@dataclass(frozen=True)
class Folder(Var[Path]):
    """A path, ``~`` expanded; relative paths are relative to the working directory."""

    kind: ClassVar[str] = "path"
    expects: ClassVar[str] = "a path"

    def parse(self, text: str) -> Path:
        if "\0" in text:
            raise ValueError("it contains a NUL character")
        return Path(text).expanduser()


# --- skuforge's own -------------------------------------------------------------------------------

SKUFORGE_SIGNING_KEY = Text(
    "SKUFORGE_SIGNING_KEY",
    "the ed25519 private key publish and `release` sign with (PEM PKCS8, or base64 of its 32 raw bytes): CI's secret",
    default_doc="unset: the developer key in `SKUFORGE_KEY_DIR`",
    secret=True,
)
SKUFORGE_KEY_DIR = Folder(
    "SKUFORGE_KEY_DIR",
    "folder of the developer signing key `signing_key.pem` (made on first use, mode 0600)",
    default_doc="`$XDG_CONFIG_HOME/skuforge`, else `~/.config/skuforge`",
)
SKUFORGE_STORE = Text(
    "SKUFORGE_STORE",
    "the release store, a folder or `s3://bucket/prefix`: overrides `rollout.store` (`--store` overrides it)",
    default_doc="`rollout.store` of params.yaml",
)
SKUFORGE_REQUIRE_CACHE = Flag(
    "SKUFORGE_REQUIRE_CACHE",
    "every build fails (exit 1) on a miss of its SKU's checked-in compiler cache, as `cache.require` does "
    "(CI's release flag)",
)
SKUFORGE_TUNE = Flag(
    "SKUFORGE_TUNE",
    "a build of a TVM SKU with `options.trials > 0` tunes the tasks its checked-in tuning database lacks "
    "(unset: they get TVM's default schedules and a warning; `cache refresh` tunes from scratch)",
)
SKUFORGE_TVM_TRACKER = Text(
    "SKUFORGE_TVM_TRACKER",
    "`host:port` of TVM's RPC tracker: a TVM SKU with `options.rpc.key` tunes, validates and benchmarks on "
    "the devices registered under its key (never read from params.yaml)",
)
SKUFORGE_TVM_RPC_WAIT = Number(
    "SKUFORGE_TVM_RPC_WAIT",
    "seconds a TVM SKU with `options.rpc.key` waits for a device to register under its key, and then for one "
    "of them to be free, before it fails (exit 4)",
    default=12.0,
    minimum=0.0,
)
SKUFORGE_TVM_RPC_TIMEOUT = Number(
    "SKUFORGE_TVM_RPC_TIMEOUT",
    "seconds TVM's RPC tracker and a device each have to answer a TVM SKU with `options.rpc.key`: the "
    "connection, each tracker query, opening a session on the device, the engine's upload and load, each "
    "inference of validate and bench; past it the command fails (exit 4) naming the address. A tuning "
    "candidate is bounded by `options.rpc.session_timeout_s` instead",
    default=10.0,
    minimum=0.1,
)
SKUFORGE_CACHE_DIR = Folder(
    "SKUFORGE_CACHE_DIR",
    "folder of this host's caches: the peaks of `runner probe --peaks`, the LiteRT converter's environment, "
    "each release store's record of what this machine committed to it, "
    "the host checks' answers (`hostcheck-<key>.json`)",
    default_doc="`$XDG_CACHE_HOME/skuforge`, else `~/.cache/skuforge`",
)
SKUFORGE_LITERT_CONVERTER = Folder(
    "SKUFORGE_LITERT_CONVERTER",
    "the LiteRT converter's virtualenv (onnx2tf and TensorFlow from "
    "pipeline/backends/litert_converter/requirements.lock; `python -m pipeline.backends.litert_converter` makes it)",
    default_doc="`$SKUFORGE_CACHE_DIR/litert-converter-<the lock's sha256[:12]>`",
)
SKUFORGE_EMULATION_DIR = Folder(
    "SKUFORGE_EMULATION_DIR",
    "folder of the aarch64 environments run under QEMU user-mode emulation (`emulation-aarch64-<hash>`: Debian's "
    "arm64 Python and the runtimes' aarch64 wheels; `python -m pipeline.host.emulation` makes one)",
    default_doc="`$SKUFORGE_CACHE_DIR`",
)
SKUFORGE_FAKE_CPU_FLAGS = Text(
    "SKUFORGE_FAKE_CPU_FLAGS",
    "testing hook: the CPU flags this host reports instead of `/proc/cpuinfo`'s (space- or comma-separated "
    "kernel names; empty: none)",
)
SKUFORGE_FAKE_CPU_MODEL = Text(
    "SKUFORGE_FAKE_CPU_MODEL",
    "testing hook: the CPU model name this host reports",
)

# --- the system's ---------------------------------------------------------------------------------

XDG_CONFIG_HOME = Folder(
    "XDG_CONFIG_HOME", "base of `SKUFORGE_KEY_DIR`'s default", default_doc="`~/.config`", owner="XDG"
)
XDG_CACHE_HOME = Folder(
    "XDG_CACHE_HOME", "base of `SKUFORGE_CACHE_DIR`'s default", default_doc="`~/.cache`", owner="XDG"
)


PATH = Text(
    "PATH",
    "where `nvidia-smi` and the compilers' tools are found; the GPU probe is cached per value",
    default="",
    default_doc="empty",
    owner="the system",
)

# --- DVC's ----------------------------------------------------------------------------------------

DVC_STAGE = Text(
    "DVC_STAGE",
    "set by dvc for the stage it runs: a stage command that fails under it records its outcome in "
    "`build/.outcomes/` for `repro` and `summary`",
    owner="DVC",
)

# --- MLflow's -------------------------------------------------------------------------------------

MLFLOW_TRACKING_URI = Text(
    "MLFLOW_TRACKING_URI",
    "the tracking store of publish, promote and releases (its password is never printed)",
    default_doc="the embedded `sqlite:///mlflow.db` at the project root",
    owner="MLflow",
)
MLFLOW_REGISTRY_URI = Text(
    "MLFLOW_REGISTRY_URI",
    "the model registry's store (its password is never printed)",
    default_doc="`MLFLOW_TRACKING_URI`",
    owner="MLflow",
)
MLFLOW_TRACKING_USERNAME = Text(
    "MLFLOW_TRACKING_USERNAME",
    "the tracking server's user: masked in all output when `MLFLOW_TRACKING_PASSWORD` is set",
    owner="MLflow",
)
MLFLOW_TRACKING_PASSWORD = Text(
    "MLFLOW_TRACKING_PASSWORD", "the tracking server's password: masked in all output", owner="MLflow", secret=True
)
MLFLOW_LOGGING_LEVEL = Text(
    "MLFLOW_LOGGING_LEVEL",
    "MLflow's log level (its INFO lines are store migrations and registry waits)",
    default_doc="`WARNING` under skuforge's MLflow commands",
    owner="MLflow",
)
MLFLOW_HTTP_REQUEST_MAX_RETRIES = Integer(
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
    "MLflow's own HTTP retries, which would hide a dead server behind `release.tracking`'s retries and deadline",
    default_doc="`0`, set by skuforge",
    owner="MLflow",
    minimum=0,
)
MLFLOW_HTTP_REQUEST_TIMEOUT = Integer(
    "MLFLOW_HTTP_REQUEST_TIMEOUT",
    "seconds MLflow waits to connect and for each answer",
    default_doc="`release.tracking.timeout_seconds` rounded up, set by skuforge",
    owner="MLflow",
    minimum=1,
)
MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT = Flag(
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT",
    "no 'View run ... at' line on stdout (it would corrupt `--json` output)",
    default_doc="`true`, set by skuforge",
    owner="MLflow",
)
MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR = Flag(
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR",
    "MLflow's upload progress bars (tqdm, in CI logs)",
    default_doc="`false`, set by skuforge",
    owner="MLflow",
)

# --- the AWS SDK's (the S3 release store) ---------------------------------------------------------

AWS_ENDPOINT_URL = Text(
    "AWS_ENDPOINT_URL",
    "an S3-compatible server for the release store; set, the store uses path-style addressing",
    default_doc="AWS's endpoints",
    owner="AWS SDK",
)
AWS_MAX_ATTEMPTS = Integer(
    "AWS_MAX_ATTEMPTS",
    "botocore's attempts per request; set (or `max_attempts` in the profile), it replaces the store's",
    default_doc="3, the store's",
    owner="AWS SDK",
    minimum=1,
)
AWS_RETRY_MODE = Text(
    "AWS_RETRY_MODE",
    "botocore's retry mode; set (or `retry_mode` in the profile), botocore's retries replace the store's",
    default_doc="`standard`, the store's",
    owner="AWS SDK",
)

# --- CI systems' (recorded on the MLflow run) -----------------------------------------------------

GITHUB_ACTOR = Text(
    "GITHUB_ACTOR",
    "who acts: the MLflow run's user, and who moved an alias or a rollout",
    default_doc="the local user",
    owner="GitHub Actions",
)
RUNNER_NAME = Text(
    "RUNNER_NAME",
    "the runner recorded on the MLflow run (`skuforge.runner`)",
    default_doc="the manifest's host",
    owner="GitHub Actions",
)
GITHUB_SERVER_URL = Text(
    "GITHUB_SERVER_URL",
    "with the repository and run id, the CI run's URL on the MLflow run (`skuforge.ci_run_url`)",
    default="https://github.com",
    owner="GitHub Actions",
)
GITHUB_REPOSITORY = Text(
    "GITHUB_REPOSITORY", "`owner/name`, for the CI run's URL (`skuforge.ci_run_url`)", owner="GitHub Actions"
)
GITHUB_RUN_ID = Text("GITHUB_RUN_ID", "the run, for the CI run's URL (`skuforge.ci_run_url`)", owner="GitHub Actions")
GITHUB_RUN_ATTEMPT = Text(
    "GITHUB_RUN_ATTEMPT", "the attempt, for the CI run's URL (`skuforge.ci_run_url`)", owner="GitHub Actions"
)
CI_JOB_URL = Text(
    "CI_JOB_URL", "the CI run's URL on the MLflow run (`skuforge.ci_run_url`), without GitHub's", owner="GitLab CI"
)
BUILD_URL = Text("BUILD_URL", "the CI run's URL on the MLflow run, without GitHub's or GitLab's", owner="Jenkins")

# --- threading (recorded in bench reports' `execution.env`) ---------------------------------------

OMP_NUM_THREADS = Integer("OMP_NUM_THREADS", "OpenMP's threads: recorded with each benchmark", owner="OpenMP")
MKL_NUM_THREADS = Integer("MKL_NUM_THREADS", "MKL's threads: recorded with each benchmark", owner="MKL")
OPENBLAS_NUM_THREADS = Integer(
    "OPENBLAS_NUM_THREADS", "OpenBLAS's threads: recorded with each benchmark", owner="OpenBLAS"
)
TVM_NUM_THREADS = Integer(
    "TVM_NUM_THREADS",
    "TVM's thread pool, sized once per process: recorded with each benchmark",
    default_doc="the TVM SKU's `num_threads`, set by skuforge",
    owner="TVM",
)
OMP_PROC_BIND = Text("OMP_PROC_BIND", "OpenMP's thread binding: recorded with each benchmark", owner="OpenMP")
OMP_PLACES = Text("OMP_PLACES", "OpenMP's places: recorded with each benchmark", owner="OpenMP")
GOMP_CPU_AFFINITY = Text(
    "GOMP_CPU_AFFINITY", "GNU OpenMP's CPU affinity: recorded with each benchmark", owner="GNU OpenMP"
)
KMP_AFFINITY = Text("KMP_AFFINITY", "Intel OpenMP's affinity: recorded with each benchmark", owner="Intel OpenMP")

# --- redaction only -------------------------------------------------------------------------------

DATABASE_URL = Text("DATABASE_URL", "a database URI: its password is masked in all output", owner="database clients")


VARIABLES: dict[str, Var] = {v.name: v for v in list(globals().values()) if isinstance(v, Var)}
"""Every declared variable by name, in declaration order (skuforge's own first)."""


def declared(name: str) -> Var:
    """The declaration of ``name``; a KeyError for a variable skuforge does not declare."""
    return VARIABLES[name]


# --- the table of docs/cli.md ---------------------------------------------------------------------

BEGIN = "<!-- environment variables: generated by `python -m pipeline.core.env --markdown`; do not edit -->"
END = "<!-- end of generated environment variables -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """The Markdown table of every declared variable (what docs/cli.md holds between BEGIN and END)."""
    lines = ["| variable | type | default | defined by | what it does |", "|---|---|---|---|---|"]
    for var in VARIABLES.values():
        kind = f"{var.kind}, secret" if var.secret else var.kind
        lines.append(f"| `{var.name}` | {kind} | {_cell(var.default_text())} | {_cell(var.owner)} | {_cell(var.doc)} |")
    return "\n".join(lines) + "\n"


def replace_table(text: str, table: str | None = None) -> str:
    """``text`` (a Markdown page) with the generated table between its BEGIN and END lines."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {BEGIN!r} ... {END!r} block")
    return text[: start + len(BEGIN)] + "\n" + (table or markdown()) + text[end:]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.core.env", description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--markdown", action="store_true", help="print the table of environment variables")
    group.add_argument("--write", metavar="FILE", help="rewrite the table in FILE (docs/cli.md) between its markers")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown())
        return 0
    path = Path(args.write)
    path.write_text(replace_table(path.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"wrote the environment variable table of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
