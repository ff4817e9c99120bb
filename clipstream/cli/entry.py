"""The entry point and its error policy: bad input is one line and exit 2, a dependency or job that failed one line
and exit 1, a bug one line and a traceback in a file."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from clipstream import console
from clipstream.cli.parser import parser
from clipstream.settings import Settings, configure_process, unknown_variables

EXIT_UNREACHABLE = 3  # the server did not answer (parser.EXIT_STATUS lists every code)

# the commands that read the store earlier commands wrote: none is made for them (Settings.existing_store)
READS_STORE = ("runs", "history", "eval", "export", "index", "promote", "rollback", "follow")
# the commands that start Ray, DeepSpeed or Ray Serve: quiet unless -v (see clipstream.console)
QUIET = ("train", "register", "eval", "index", "compact", "promote", "rollback", "follow", "serve", "demo", "bench", "ui",
         "controller")


def _quiet(command: str) -> None:
    import tempfile

    try:
        settings = Settings()
        if settings.ray_address:  # the driver of a job on a cluster (a RayJob): its output is the job's log
            return
        folder = settings.home / "logs"
    except Exception:  # (bad settings are reported by the command itself, in one line)
        folder = Path(tempfile.gettempdir())
    path = console.quiet(folder, command)
    if path:
        print(f"clipstream: Ray, DeepSpeed and MLflow log to {path} (-v shows them here)", file=console.err())


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    configure_process()  # the process's MLflow set-up, once, here at the door
    for variable, match in unknown_variables():  # a typo in a variable name would otherwise be silently ignored
        print(f"clipstream: warning: {variable} is not a setting, ignored"
              + (f" (did you mean {match}?)" if match else " (`clipstream config` lists them)"), file=console.err())
    if args.command in READS_STORE:  # before anything (the quiet mode's log folder included) is made there
        try:
            Settings().existing_store()
        except ValueError as exc:
            print(f"clipstream: error: {_one_line(exc)}", file=console.err())
            return 2
    if args.command in QUIET and not getattr(args, "verbose", False):
        if args.command == "bench":  # once the benchmark parsed its own options: its --help and errors show
            from clipstream.benchmarks import report

            report.after_parse.append(lambda: _quiet("bench"))
        else:
            _quiet(args.command)
    # MLflow's SQL store logs a database error with its traceback before raising it; the error is ours to
    # report, in one line (below)
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    try:
        code = args.func(args)
    except Exception as exc:
        if isinstance(exc, _failures() + _dependency_errors()):
            # not the input's fault (a job that failed, MLflow or the vector store down): exit 1, one line
            print(f"clipstream: error: {_one_line(exc)}", file=console.err())
            return 1
        if not isinstance(exc, _user_errors()):  # a bug: one line here, the traceback in a file
            print(f"clipstream: internal error: {type(exc).__name__}: {_one_line(exc)} (traceback in {_crash_log(exc)}; "
                  "please report it)", file=console.err())
            return 1
        rpc = _loaded("grpc")
        if rpc and isinstance(exc, rpc.RpcError):  # the service's own status and message
            unreachable = exc.code() in (rpc.StatusCode.UNAVAILABLE, rpc.StatusCode.DEADLINE_EXCEEDED)
            hint = " (no server answered: is `clipstream serve` running there? --address names another)" * unreachable
            print(f"clipstream: error: {exc.code().name}: {' '.join(str(exc.details()).split())}{hint}",
                  file=console.err())
            return EXIT_UNREACHABLE if unreachable else 2
        print(f"clipstream: error: {_one_line(exc)}", file=console.err())
        return 2
    return code or 0


def _one_line(exc: Exception) -> str:
    """The message on one line; a settings error (pydantic) as `field: reason` pairs."""
    errors = getattr(exc, "errors", None)
    if callable(errors) and type(exc).__name__ == "ValidationError":
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg'].removeprefix('Value error, ')}"
                         for e in errors())
    return " ".join(str(exc).split())


def _crash_log(exc: Exception) -> Path:
    """The traceback written under HOME/logs (the temp dir when the settings themselves cannot be read)."""
    import tempfile
    import traceback

    try:
        folder = Settings().home / "logs"
        folder.mkdir(parents=True, exist_ok=True)
    except Exception:
        folder = Path(tempfile.gettempdir())
    path = folder / f"clipstream-crash-{time.strftime('%Y%m%d-%H%M%S')}.log"
    path.write_text(f"clipstream {' '.join(sys.argv[1:])}\n" + "".join(traceback.format_exception(exc)))
    return path


def _user_errors() -> tuple[type[Exception], ...]:
    """What a user's input can cause: bad data, a reference the registry does not know, a bad value, a missing
    file, a status from the service. Read from the modules a command loaded (a module that was never imported
    raised nothing), so that `data synth` does not pay for importing MLflow and gRPC."""
    return (ValueError, FileNotFoundError, FileExistsError) + _loaded_errors(
        ("clipstream.training.data.task", "DataError"), ("clipstream.registry", "RegistryError"), ("grpc", "RpcError"),
        ("clipstream.services.binding", "BindingError"))


def _dependency_errors() -> tuple[type[Exception], ...]:
    """What a dependency that is down raises: MLflow (a server that does not answer, a locked database), the
    vector store (a Qdrant server that does not answer), the network."""
    return (ConnectionError, TimeoutError) + _loaded_errors(
        ("mlflow.exceptions", "MlflowException"), ("qdrant_client.http.exceptions", "ResponseHandlingException"))


def _failures() -> tuple[type[Exception], ...]:
    """A training job that failed, a local Ray that did not start: not the input's fault either."""
    return _loaded_errors(("clipstream.training.job", "TrainingFailed"), ("clipstream.runtime", "RayStartError"))


def _loaded_errors(*names: tuple[str, str]) -> tuple[type[Exception], ...]:
    """The exception classes (module, name) of the modules already imported: one never imported raised nothing."""
    return tuple(getattr(_loaded(module), name) for module, name in names if _loaded(module))


def _loaded(module: str):
    return sys.modules.get(module)
