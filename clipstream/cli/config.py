"""`clipstream config`: the effective settings and where each came from."""

from __future__ import annotations

from clipstream.cli.render import format_table, print_json
from clipstream.settings import Settings, effective, unknown_variables


def _config(args) -> None:
    settings = Settings()
    rows, unknown = effective(settings), unknown_variables()
    if args.json:
        return print_json({"settings": rows, "unknown_variables": [{"variable": v, "did_you_mean": m}
                                                                   for v, m in unknown]})
    home = next(r["source"] for r in rows if r["setting"] == "home")
    print(f"state lives under {settings.home}" + (
        " (the default, ./.clipstream of this folder: a command run in another folder starts another one; set "
        "CLIPSTREAM_HOME to keep one)" if home == "default" else f" (from {home})"))
    print(format_table([("setting", "value", "source")] + [(r["setting"], "-" if r["value"] is None else str(r["value"]),
                                                            r["source"]) for r in rows]))
