"""MkDocs hooks (mkdocs.yml `hooks:`): the generated parts of the reference pages.

A page asks for one with a line `<!-- generated: NAME -->`; the build replaces it with what the
code says today: the config keys from the pydantic models, the commands from the CLI's help, the
contracts from proto/. A name no generator knows fails the build.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_reference import cli_reference
from config_reference import configuration_reference
from proto_reference import implementers_guide, proto_reference

GENERATORS: dict[str, Callable[[], str]] = {
    "configuration": configuration_reference,
    "cli": cli_reference,
    "protocol-messages": proto_reference,
    "implementers-guide": implementers_guide,
}
MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)


def generated(name: str) -> str:
    if name not in GENERATORS:
        raise KeyError(f"no generator named {name!r}; known: {', '.join(sorted(GENERATORS))}")
    return GENERATORS[name]()


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **_: Any) -> str:
    return MARKER.sub(lambda match: generated(match.group(1)), markdown)
