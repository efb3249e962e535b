"""The ``skuforge`` command: parse arguments, call one library function, render, exit.

Argument parsing imports nothing heavy (pipeline/cli/parser/): a command's module, which imports
the library, is loaded when the command runs (``handler``).
Exit codes: 0 ok, 1 gate failed, 2 bad config or input, 3 environment, 4 external service,
70 internal error, 130 interrupted (Ctrl-C), 143 terminated (SIGTERM); either ends the processes the
command started. Everything the command prints (its output, log
records, warnings, errors and the traceback of a bug) passes through :func:`pipeline.core.redact.redact`:
no credential leaves it. A stage command also records its failure for ``skuforge repro``'s matrix.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pipeline.cli.parser import build_parser
from pipeline.cli.parser.commands import STAGE_COMMANDS
from pipeline.core import budget, redact
from pipeline.core.env import DVC_STAGE
from pipeline.core.errors import (
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    EnvironmentProblem,
    InputError,
    SkuforgeError,
    TimedOut,
)
from pipeline.core.io import storage_error
from pipeline.core.processes import Terminated, end_descendants, sigterm_as_interrupt
from pipeline.results.outcomes import clear_outcome, record_outcome

# Loggers that log a traceback for an error skuforge reports itself in one line (-v shows them).
_NOISY = ("mlflow.store.db.utils",)
# Loggers of the AWS SDK that talk at INFO ("Found credentials in environment variables") on every
# S3 command: warnings and errors only, even with -v.
_QUIET = ("botocore", "boto3", "s3transfer", "urllib3")


def handler(ref: str) -> Callable[[argparse.Namespace], int | None]:
    """The function a parsed command names ("pipeline.cli.<group>:<function>"), loaded when the
    command runs: parsing arguments and `--help` import no library code (cli/ is the top layer, so
    loading a command module late hides no import cycle; tests/cli checks every name resolves)."""
    module, _, name = ref.partition(":")
    if not module.startswith("pipeline.cli."):
        raise ValueError(f"not a command handler: {ref!r}")
    return getattr(importlib.import_module(module), name)


def _drop_tracebacks(record: logging.LogRecord) -> bool:
    return record.exc_info is None and record.exc_text is None


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="%(levelname).1s %(message)s", stream=sys.stderr
    )
    for name in _NOISY:
        logger = logging.getLogger(name)
        if verbose:
            logger.removeFilter(_drop_tracebacks)
        elif _drop_tracebacks not in logger.filters:
            logger.addFilter(_drop_tracebacks)
    for name in _QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)


def _os_error(exc: OSError) -> SkuforgeError | None:
    """A file-system error no library code turned into a message: still one the user can act on."""

    if exc.filename is None:
        return None
    err = storage_error(exc)
    if err is not None:
        return err
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return InputError(f"{exc.filename}: {exc.strerror}", hint="check the path (run the step that writes it first)")
    return EnvironmentProblem(
        f"cannot access {exc.filename}: {exc.strerror}",
        hint="check the file's permissions and the disk, then run again",
    )


_PIPELINE_EXTRA = frozenset({"scipy", "onnx", "ruamel", "jsonschema", "dvc", "mlflow", "jinja2", "matplotlib"})
"""Top-level modules of the `pipeline` extra: an agent-only install (`skuforge[agent]`) lacks them."""


def _missing_module(exc: ModuleNotFoundError) -> SkuforgeError | None:
    """A build command run where only the device agent is installed: say which extra to install."""
    top = (exc.name or "").split(".")[0]
    if top not in _PIPELINE_EXTRA:
        return None
    return EnvironmentProblem(
        f"this command needs {top}, which the device agent's install (skuforge[agent]) leaves out",
        hint="install the build toolchain: pip install 'skuforge[pipeline]'",
    )


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
        previous = budget.on_hard_stop(lambda exc: _hard_stop(args, exc))
        try:
            with sigterm_as_interrupt():
                return _run(args)
        finally:
            budget.on_hard_stop(previous)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        installed.undo()


def _run(args: argparse.Namespace) -> int:
    try:
        code = int(handler(args.handler)(args) or 0)
    except SkuforgeError as exc:
        return _record(args, _error(exc), exc)
    except KeyboardInterrupt:
        # The interrupted frames hold the loaded engine in reference cycles: release it now, not
        # during interpreter shutdown, where ONNX Runtime aborts ("terminate called ...", exit -6).
        import gc

        gc.collect()
        terminated = isinstance(sys.exc_info()[1], Terminated)
        print(f"skuforge: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader went away (`skuforge ... | head`): nothing left to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return _record(args, 0, None)
    except OSError as exc:
        err = _os_error(exc)
        if err is not None:
            return _record(args, _error(err), err)
        return _record(args, _bug(), exc)
    except ModuleNotFoundError as exc:
        err = _missing_module(exc)
        return _record(args, _error(err), err) if err is not None else _record(args, _bug(), exc)
    except Exception as exc:
        return _record(args, _bug(), exc)
    return _record(args, code, None)


def _stage_of(args: argparse.Namespace) -> tuple[str, str | None, str | None] | None:
    """(stage, model, SKU) when the command is a dvc.yaml stage's command, else None."""
    if args.command in STAGE_COMMANDS or (args.command == "publish" and not args.all and args.model and args.sku):
        return args.command, args.model, getattr(args, "sku", None)
    if args.command == "config" and args.config_command == "resolve":
        return "config", None, None
    return None


def _record(args: argparse.Namespace, code: int, exc: BaseException | None) -> int:
    """A stage command run by dvc leaves its failure where `skuforge repro` and `summary` read it
    (dvc's own output says only "exited with N"); any run of it removes that record when it succeeds.
    Run by hand, a failure writes nothing: its message is on the user's screen."""
    stage = _stage_of(args)
    if stage is None or (code != 0 and not DVC_STAGE.is_set()):  # dvc sets DVC_STAGE for its stages
        return code
    root = Path(args.params).resolve().parent
    try:
        if code == 0:
            clear_outcome(root, *stage)
        else:
            message = (
                exc.message
                if isinstance(exc, SkuforgeError)
                else f"internal error (a bug): {type(exc).__name__}: {exc}"
            )
            record_outcome(root, *stage, exit_code=code, message=message, error=exc)
    except (OSError, SkuforgeError) as err:  # a full disk, say: never let the record hide the stage's own result
        logging.getLogger(__name__).debug("could not update the outcome record of %s: %s", stage, err)
    return code


def _hard_stop(args: argparse.Namespace, exc: TimedOut) -> None:
    """A stage's time budget ran out inside an engine call (pipeline/core/budget.py), which Python
    cannot interrupt: report and record the failed gate as any other, then leave with the call in flight."""
    code = _record(args, _error(exc), exc)
    end_descendants()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _bug() -> int:
    import traceback

    sys.stderr.write(redact.redact(traceback.format_exc()))
    print("skuforge: internal error (a bug): please report it with the traceback above", file=sys.stderr)
    return EXIT_INTERNAL


def run() -> None:
    try:
        code = main()
    except KeyboardInterrupt as exc:  # Ctrl-C outside a command (while parsing, importing, flushing)
        terminated = isinstance(exc, Terminated)
        print(f"skuforge: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        code = EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    if code in (EXIT_INTERRUPTED, EXIT_TERMINATED):
        # Interrupted: a compiler runtime may still own native threads (a bench worker inside an
        # inference call, a thread pool mid-task), and tearing the interpreter down under them aborts
        # ("terminate called without an active exception", exit -6, seen under load). Everything
        # that writes has unwound (atomic writes, temporary folders); what this command started
        # (a compiler's tuning workers, say) is ended, and it leaves without native teardown.
        end_descendants()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
