"""A server's log starts without the warnings that are expected on a CPU machine (torchao's
compiled extensions, Triton, torch's pytree deprecation): at most one DEBUG line says they were
silenced, so a warning in the log means something."""

from __future__ import annotations

import pytest

from sciproto.processes import start_server

NOISE = ("Failed to load", "Detected no triton", "_pytree", "is an Enum subclass")


@pytest.mark.parametrize("verbose", [False, True])
def test_policy_server_log_has_no_expected_noise(verbose: bool) -> None:
    server = start_server(["serve", "policy", "--model", "tiny", "--port", "0", *(["--verbose"] if verbose else [])],
                          timeout_s=180)
    try:
        log = list(server.output)
    finally:
        server.stop()
    noisy = [line for line in log if any(text in line for text in NOISE)]
    assert not noisy, noisy
    notes = [line for line in log if "start-up warnings expected on this machine were silenced" in line]
    assert len(notes) == (1 if verbose else 0), notes
    if notes:
        assert " DEBUG " in notes[0]
