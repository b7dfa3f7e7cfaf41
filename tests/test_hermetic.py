"""The test run reaches nothing but loopback: `scripts/test.sh` runs pytest in a network namespace of
its own whose only interface is `lo` (`unshare -n`), so nothing a test starts (Ray, whose dashboard
probes the cloud metadata address at start-up; servers; browsers) can send a packet off the machine.

Where test.sh may not create the namespace (not root, no CAP_SYS_ADMIN) it says so and sets
SCIPROTO_TEST_NETWORK=host, and these tests skip; on CI (`CI` set) they never skip. Run outside
test.sh, with the machine's network, they fail: that is what they check."""

from __future__ import annotations

import errno
import os
import socket

import pytest

from tests.conftest import INTERFACES, LOOPBACK_ONLY

UNISOLATED = os.environ.get("SCIPROTO_TEST_NETWORK") == "host" and not os.environ.get("CI")


@pytest.mark.skipif(UNISOLATED, reason="scripts/test.sh could not create a loopback-only network namespace here")
def test_the_only_network_interface_is_loopback() -> None:
    assert LOOPBACK_ONLY, (
        f"this test run sees the interfaces {INTERFACES}: run the suite with scripts/test.sh, which runs "
        "it in a network namespace whose only interface is lo")


@pytest.mark.skipif(UNISOLATED, reason="scripts/test.sh could not create a loopback-only network namespace here")
def test_an_address_off_the_machine_cannot_be_reached() -> None:
    # The cloud metadata address Ray's dashboard probes at start-up: no route, refused at once. Probed
    # only where lo is the only interface, so that this test itself never sends a packet off the machine.
    assert LOOPBACK_ONLY, f"not probing an outside address with the interfaces {INTERFACES} up"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(2)
        code = probe.connect_ex(("169.254.169.254", 80))
    assert code == errno.ENETUNREACH, f"connect to 169.254.169.254:80 gave {errno.errorcode.get(code, code)}"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server, socket.create_connection(
            ("127.0.0.1", _listen(server)), timeout=5):
        pass  # loopback still works


def _listen(server: socket.socket) -> int:
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    return server.getsockname()[1]
