"""The conformance kit: behaviour checks any sciproto server must pass, run over the wire.

    report = await check_env(ChannelConfig(target="127.0.0.1:50051"))
    print(report.render())            # PASS/FAIL per check, then a summary line

It speaks only the contract (the generated stubs in `sciproto.pb`, google.rpc error details,
gRPC health and reflection) and imports no server code, so it checks a server written in any
language. `sciproto conformance env|policy HOST:PORT` runs it from the command line.
"""

from sciproto.conformance.env_checks import check_env
from sciproto.conformance.policy_checks import check_policy
from sciproto.conformance.report import CheckResult, Outcome, Report

__all__ = ["CheckResult", "Outcome", "Report", "check_env", "check_policy"]
