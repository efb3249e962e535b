"""The ``skuforge`` command: parse arguments, call one library function, render, exit.

Argument parsing imports nothing heavy: each command imports the library when it runs.
Exit codes: 0 ok, 1 gate failed, 2 bad config or input, 3 environment, 4 external service,
70 internal error. Everything the command prints (its output, log records, warnings, errors and
the traceback of a bug) passes through :func:`pipeline.redact.redact`: no credential leaves it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from .. import redact
from ..errors import EXIT_INTERNAL, EnvironmentProblem, InputError, SkuforgeError
from . import ci, commands, keys

# Loggers that log a traceback for an error skuforge reports itself in one line (-v shows them).
_NOISY = ("mlflow.store.db.utils",)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="skuforge",
        description="Build, gate, benchmark and describe ML inference engines per device SKU.",
        epilog="exit codes: 0 ok, 1 gate failed, 2 bad config or input, 3 environment (backend, hardware, "
               "toolchain), 4 external service, 70 internal error",
    )
    parser.add_argument("--params", default="params.yaml", help="the registry (default: params.yaml)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands.register(sub)
    ci.register(sub)
    keys.register(sub)
    return parser


def _drop_tracebacks(record: logging.LogRecord) -> bool:
    return record.exc_info is None and record.exc_text is None


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(levelname).1s %(message)s", stream=sys.stderr)
    for name in _NOISY:
        logger = logging.getLogger(name)
        if verbose:
            logger.removeFilter(_drop_tracebacks)
        elif _drop_tracebacks not in logger.filters:
            logger.addFilter(_drop_tracebacks)


def _os_error(exc: OSError) -> SkuforgeError | None:
    """A file-system error no library code turned into a message: still one the user can act on."""
    from ..io import storage_error

    if exc.filename is None:
        return None
    err = storage_error(exc)
    if err is not None:
        return err
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return InputError(f"{exc.filename}: {exc.strerror}", hint="check the path (run the step that writes it first)")
    return EnvironmentProblem(f"cannot access {exc.filename}: {exc.strerror}",
                              hint="check the file's permissions and the disk, then run again")


def _error(exc: SkuforgeError) -> int:
    print(f"skuforge: error: {redact.redact(exc.message)}", file=sys.stderr)
    if exc.hint:
        print(f"  hint: {redact.redact(exc.hint)}", file=sys.stderr)
    return exc.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    installed = redact.install()
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        _setup_logging(args.verbose)
        return _run(args)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        installed.undo()


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args) or 0)
    except SkuforgeError as exc:
        return _error(exc)
    except KeyboardInterrupt:
        print("skuforge: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        err = _os_error(exc)
        if err is not None:
            return _error(err)
        return _bug()
    except Exception:
        return _bug()


def _bug() -> int:
    import traceback

    sys.stderr.write(redact.redact(traceback.format_exc()))
    print("skuforge: internal error (a bug): please report it with the traceback above", file=sys.stderr)
    return EXIT_INTERNAL


def run() -> None:
    sys.exit(main())
