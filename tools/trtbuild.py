"""`trtbuild`: the cosytrt command line (build engine sets, synthesize, check, report, serve)."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module in cosytrt.tools exposing add_arguments(parser) and run(args) -> int
SUBCOMMANDS = {
    "golden": ("golden", "recompute the golden vectors of a golden directory and compare (exit 1 on failure)"),
    "synth": ("synth", "synthesize speech to a WAV file"),
    "build": ("build_cmd", "build an engine set from a bucket profile"),
    "inspect": ("inspect_cmd", "print an engine set's manifest as a table"),
    "coverage": ("coverage", "bucket coverage report for a workload"),
    "parity": ("parity", "engine-vs-eager parity check"),
    "bench": ("bench.cli", "GPU benchmarks (stage micro-benchmarks, the serving matrix, open-loop traffic)"),
    "serve": ("serve", "OpenAI-compatible speech server"),
}


def _version() -> str:
    import platform

    from cosytrt import __version__

    try:
        import torch

        tv = torch.__version__
    except ImportError:  # pragma: no cover
        tv = "absent"
    return f"cosytrt {__version__} (torch {tv}, Python {platform.python_version()})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trtbuild", description="cosytrt: compiled-engine CosyVoice3 TTS")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, (modname, help_text) in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(f"cosytrt.tools.{modname}")
        except ModuleNotFoundError as e:
            if e.name != f"cosytrt.tools.{modname}":
                raise
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(p)
        modules[name] = mod
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    from cosytrt.engines.errors import CosytrtError

    try:
        return int(modules[args.command].run(args) or 0)
    except CosytrtError as e:
        print(f"trtbuild {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `trtbuild inspect --json DIR | head`: the reader left, not an error
        _silence_stdout()
        return 0


def _silence_stdout() -> None:
    """After a broken pipe: point stdout at devnull so the interpreter's final flush does not raise again."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # pragma: no cover - stdout without a file descriptor
        pass


if __name__ == "__main__":
    sys.exit(main())
