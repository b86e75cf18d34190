"""What the benchmark scripts' command lines share: a preset (--smoke, --quick) fills the options left at their
defaults, and --out picks where the JSON goes (a smoke run writes nothing unless asked)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def apply_preset(parser: argparse.ArgumentParser, ns: argparse.Namespace, preset: dict[str, Any]) -> None:
    """Sets each option of preset (dest -> value) on ns where the command line left it at its default; mutates ns."""
    for key, value in preset.items():
        if parser.get_default(key) == getattr(ns, key):
            setattr(ns, key, value)


def output_path(out: Path | None, smoke: bool, default: Path) -> Path | None:
    """out when given; else None for a smoke run, default otherwise."""
    if out is not None:
        return out
    if smoke:
        return None
    return default


def write_result(result: dict[str, Any], out: Path | None, smoke: bool, default: Path) -> None:
    """Writes result as indented JSON to output_path(out, smoke, default), making its folder (nothing for a smoke
    run without --out)."""
    path = output_path(out, smoke, default)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")


def run_mode(smoke: bool, quick: bool) -> str:
    """The name of the run's size: "smoke", "quick" or "full" (smoke wins when both are given)."""
    if smoke:
        return "smoke"
    if quick:
        return "quick"
    return "full"
