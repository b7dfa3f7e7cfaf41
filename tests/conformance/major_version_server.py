"""`sciproto ARGS` (e.g. `serve env --env toy --port 0`) whose servers report protocol 2.0: a server
of a major version after this one, for tests/conformance/test_protocol_major.py.

    python -m tests.conformance.major_version_server serve policy --model tiny --port 0
"""

from __future__ import annotations

import sys

import sciproto.version

# Before the command line imports sciproto.server, which reads the version at import.
sciproto.version.PROTOCOL_VERSION = "2.0"

from clients.cli import main

if __name__ == "__main__":
    main(sys.argv[1:])
