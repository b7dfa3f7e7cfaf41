"""The `sciproto` command: an application, above every component it starts.

Sub-commands import their component lazily, so `sciproto --help` and
`sciproto describe` start fast and need neither torch nor Aviary.

`main()` is the entry point: a command that fails prints what is wrong and
what to do in one or two lines and exits non-zero (`--debug`, anywhere on the
command line, shows the traceback instead; see `sciproto.cli_errors`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer

from sciproto import cli_errors, quiet
from sciproto.processes import watch_parent
from sciproto.version import PROTOCOL_VERSION, __version__

DEFAULT_PORTS = {"env": 50051, "policy": 50052, "learner": 50053}

# OpenMP worker threads spin while they wait by default; with several sciproto
# processes sharing a few cores (a local training run) that spinning slows the
# model steps by orders of magnitude. Must be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

app = typer.Typer(help="sciproto: gRPC environments, policy and learner for RL on LLM agents.",
                  no_args_is_help=True, add_completion=False)
serve_app = typer.Typer(help="Run a server: env, policy, learner or gateway.", no_args_is_help=True)
app.add_typer(serve_app, name="serve")

ConfigOption = Annotated[str | None, typer.Option("--config", "-c", help="YAML file, or a name in configs/")]
SetOption = Annotated[list[str] | None, typer.Option("--set", help="Override a config key: key.path=value (repeatable)")]
HostOption = Annotated[str | None, typer.Option(help="Interface to bind (default 127.0.0.1)")]
AuthOption = Annotated[Path | None, typer.Option("--auth", help="YAML file mapping roles to token sources")]
# One name, no --no-verbose: a second name column squeezes the option names in an 80-column help.
VerboseOption = Annotated[bool, typer.Option("--verbose", help="Log at debug level")]


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet.expected_startup_noise()


DEBUG_HELP = "--debug (anywhere on the command line): on a failure, show the traceback instead of one line."


def _mention_debug(typer_app: typer.Typer) -> None:
    """Every command's --help says what --debug does: every failure's message advises it."""
    typer_app.info.epilog = typer_app.info.epilog or DEBUG_HELP
    for command in typer_app.registered_commands:
        command.epilog = command.epilog or DEBUG_HELP
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _mention_debug(group.typer_instance)


def main(argv: Sequence[str] | None = None) -> None:
    """Run `sciproto ARGV` (default: the process's arguments) and exit with its status."""
    _mention_debug(app)
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    watch_parent()  # a server started by `sciproto train` stops when train is gone
    words = list(itertools.takewhile(lambda a: not a.startswith("-"), args))[:2]
    raise SystemExit(cli_errors.run(lambda: app(args=args, prog_name="sciproto"),
                                    command=" ".join(["sciproto", *words]), debug=debug))


def _server_overrides(component: str, host: str | None, port: int | None, auth: Path | None,
                      extra: list[str] | None) -> list[str]:
    # Precedence: an option (--port, --host, --auth), then --set, then the file, then the
    # default port (`?=`: set only when nothing else did).
    flags = [f"server.port={port}"] if port is not None else []
    flags += [f"server.host={host}"] if host is not None else []
    flags += [f"auth.file={auth}"] if auth is not None else []
    return [f"server.port?={DEFAULT_PORTS[component]}", *(extra or []), *flags]


@serve_app.command("env")
def serve_env(
    config: ConfigOption = None,
    env: Annotated[list[str] | None, typer.Option("--env", help="Environment to host (repeatable)")] = None,
    host: HostOption = None,
    port: Annotated[int | None, typer.Option(help=f"Port (default {DEFAULT_PORTS['env']}; 0 = any free)")] = None,
    auth: AuthOption = None,
    set_: SetOption = None,
    workers: Annotated[int, typer.Option(min=1, help="Server processes, one port each from --port on"
                                                    " (0: each a free one); spread episodes over them"
                                                    " with a replica pool")] = 1,
    verbose: VerboseOption = False,
) -> None:
    """Serve Aviary environments over EnvironmentService."""
    _setup_logging(verbose)
    overrides = _server_overrides("env", host, port, auth, set_)
    if env:
        overrides.append(f"envs=[{','.join(env)}]")
    if workers > 1:
        from env_servers.workers import main as serve_workers

        serve_workers(config, overrides, workers, verbose)
        return
    from env_servers.app import main as serve

    serve(config, overrides)


@serve_app.command("policy")
def serve_policy(
    config: ConfigOption = None,
    model: Annotated[str | None, typer.Option(help="tiny, smollm2, or a local model directory")] = None,
    backend: Annotated[str | None, typer.Option(help="transformers, vllm or openai")] = None,
    host: HostOption = None,
    port: Annotated[int | None, typer.Option(help=f"Port (default {DEFAULT_PORTS['policy']}; 0 = any free)")] = None,
    auth: AuthOption = None,
    set_: SetOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Serve a policy model over PolicyService."""
    _setup_logging(verbose)
    overrides = _server_overrides("policy", host, port, auth, set_)
    overrides += [f"model={model}"] if model else []
    overrides += [f"backend={backend}"] if backend else []
    from policy_server.app import main as serve

    serve(config, overrides)


@serve_app.command("learner")
def serve_learner(
    config: ConfigOption = None,
    host: HostOption = None,
    port: Annotated[int | None, typer.Option(help=f"Port (default {DEFAULT_PORTS['learner']}; 0 = any free)")] = None,
    auth: AuthOption = None,
    set_: SetOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Serve the GRPO learner over LearnerService."""
    _setup_logging(verbose)
    from learner.app import main as serve

    serve(config, _server_overrides("learner", host, port, auth, set_))


@serve_app.command("gateway")
def serve_gateway(
    policy: Annotated[list[str], typer.Option("--policy", help="Policy server HOST:PORT (repeatable: replicas)")],
    host: HostOption = None,
    port: Annotated[int, typer.Option(help="HTTP port (0 = any free)")] = 8000,
    auth: AuthOption = None,
    model_name: Annotated[list[str] | None, typer.Option("--model-name", help="Another name the model answers to (repeatable)")] = None,
    policy_token_file: Annotated[Path | None, typer.Option(help="File holding the gateway's bearer token for the policy servers")] = None,
    rollouts: Annotated[Path | None, typer.Option(help="Append closed sessions' rollout records to this JSONL file")] = None,
    max_sessions: Annotated[int, typer.Option(min=1, help="Open sessions at most")] = 1024,
    session_ttl: Annotated[float, typer.Option(min=1, help="Seconds an idle session is kept")] = 3600.0,
    max_session_tokens: Annotated[int, typer.Option(min=1, help="Recorded tokens of one session at most")] = 1 << 20,
    max_held_records: Annotated[int, typer.Option(min=1, help="Closed sessions' records held until taken; past it "
                                                  "the oldest go to --rollouts only, or closes wait without it")] = 4096,
    max_request_bytes: Annotated[int, typer.Option(min=1, help="Largest request body, in bytes; a larger one is "
                                                   "refused (413) before it is read")] = 4 * 1024 * 1024,
    verbose: VerboseOption = False,
) -> None:
    """Serve an OpenAI-compatible HTTP API over the policy servers, recording sessions for training."""
    _setup_logging(verbose)
    from gateway.app import main_with

    main_with(
        policies=policy, host=host or "127.0.0.1", port=port, model_names=model_name or [], auth_file=auth,
        policy_token_file=policy_token_file, rollouts_file=rollouts, max_sessions=max_sessions,
        idle_ttl_s=session_ttl, max_session_tokens=max_session_tokens, max_held_records=max_held_records,
        max_request_bytes=max_request_bytes)


@app.command("agent-collect")
def agent_collect(
    env: Annotated[str, typer.Option("--env", help="Env server HOST:PORT")],
    policy: Annotated[str, typer.Option("--policy", help="Policy server HOST:PORT")],
    command: Annotated[str, typer.Option("--command", help="The agent program, run once per sample (shell words)")],
    task_env: Annotated[str, typer.Option(help="Environment name on the env server")] = "toy",
    split: Annotated[str, typer.Option(help="Split of its tasks")] = "train",
    tasks: Annotated[int, typer.Option(min=1, help="Tasks 0..N-1 of the split")] = 1,
    group_size: Annotated[int, typer.Option(min=1, help="Runs per task (a GRPO group)")] = 2,
    out: Annotated[Path, typer.Option(help="Rollout JSONL file to append to")] = Path("agent_rollouts.jsonl"),
    timeout: Annotated[float, typer.Option(min=1, help="Seconds one run may take")] = 600.0,
    preload: Annotated[list[str] | None, typer.Option(help="A Python module the agent imports, imported once in a "
                                                      "fork server whose forks are the runs (repeatable; the command "
                                                      "must be PYTHON SCRIPT [ARGS])")] = None,
) -> None:
    """Run an external OpenAI-API agent over an env's tasks through the gateway; write rollouts."""
    from clients.agent_command import main as run_agents

    run_agents(
        env_target=env, policy_target=policy, env=task_env, split=split, tasks=range(tasks), group_size=group_size,
        command=command, out=out, timeout_s=timeout, preload=tuple(preload or ()))


@app.command()
def describe(
    target: Annotated[str, typer.Argument(help="HOST:PORT of any sciproto server")],
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each call")] = 10.0,
    token: Annotated[str | None, typer.Option(envvar="SCIPROTO_TOKEN", help="Bearer token")] = None,
    ca_cert: Annotated[Path | None, typer.Option(help="PEM CA bundle: use TLS")] = None,
) -> None:
    """Print a server's health, services and Describe as JSON."""
    from sciproto.channel import ChannelConfig, TlsClientConfig
    from sciproto.describe import describe as run_describe
    from sciproto.describe import to_json

    tls = TlsClientConfig(ca_cert=ca_cert) if ca_cert else None
    config = ChannelConfig(target=target, default_timeout_s=timeout, max_attempts=1, token=token, tls=tls)
    typer.echo(to_json(asyncio.run(run_describe(config))))


conformance_app = typer.Typer(help="Check a server against the protocol's behaviour, over the wire.",
                              no_args_is_help=True)
app.add_typer(conformance_app, name="conformance")
OnlyOption = Annotated[list[str] | None, typer.Option("--only", help="Run only this check (repeatable)")]


def _run_conformance(kind: str, target: str, timeout: float, token: str | None, ca_cert: Path | None,
                     as_json: bool, only: list[str] | None, env: str | None = None, close_wait: float = 10.0,
                     semantic: bool = False, tasks_per_split: int = 2) -> None:
    from sciproto.channel import ChannelConfig, TlsClientConfig
    from sciproto.conformance import check_env, check_policy

    tls = TlsClientConfig(ca_cert=ca_cert) if ca_cert else None
    config = ChannelConfig(target=target, default_timeout_s=timeout, max_attempts=1, token=token, tls=tls)
    run = (check_env(config, env=env, timeout_s=timeout, only=only, close_wait_s=close_wait, semantic=semantic,
                     tasks_per_split=tasks_per_split) if kind == "env"
           else check_policy(config, timeout_s=timeout, only=only))
    report = asyncio.run(run)
    typer.echo(report.to_json() if as_json else report.render())
    raise typer.Exit(0 if report.ok else 1)


@conformance_app.command("env")
def conformance_env(
    target: Annotated[str, typer.Argument(help="HOST:PORT of an EnvironmentService")],
    env: Annotated[str | None, typer.Option("--env", help="Environment to check (default: the first hosted)")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds each check may take")] = 30.0,
    token: Annotated[str | None, typer.Option(envvar="SCIPROTO_TOKEN", help="Bearer token (roles agent, grader, observer)")] = None,
    ca_cert: Annotated[Path | None, typer.Option(help="PEM CA bundle: use TLS")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON")] = False,
    only: OnlyOption = None,
    close_wait: Annotated[float, typer.Option(help="Seconds the episodes of an ended or cancelled Session may"
                                                   " take to close")] = 10.0,
    semantic: Annotated[bool, typer.Option("--semantic", help="Also check what the rewards mean: reference answers"
                                                             " reach the top, empty and junk replies the baseline,"
                                                             " seeds repeat, stored trajectories grade as live")] = False,
    tasks_per_split: Annotated[int, typer.Option(min=1, help="Tasks of each split the semantic checks play")] = 2,
) -> None:
    """Run the environment-server checks; exit 1 if any fails."""
    _run_conformance("env", target, timeout, token, ca_cert, as_json, only, env, close_wait, semantic,
                     tasks_per_split)


@conformance_app.command("policy")
def conformance_policy(
    target: Annotated[str, typer.Argument(help="HOST:PORT of a PolicyService")],
    timeout: Annotated[float, typer.Option(help="Seconds each check may take")] = 60.0,
    token: Annotated[str | None, typer.Option(envvar="SCIPROTO_TOKEN", help="Bearer token (roles agent, observer; trainer for the weights check)")] = None,
    ca_cert: Annotated[Path | None, typer.Option(help="PEM CA bundle: use TLS")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON")] = False,
    only: OnlyOption = None,
) -> None:
    """Run the policy-server checks; exit 1 if any fails."""
    _run_conformance("policy", target, timeout, token, ca_cert, as_json, only)


@app.command()
def verify(
    rollouts: Annotated[Path, typer.Argument(help="JSONL file written by `sciproto collect` or `train`")],
    env: Annotated[str, typer.Option("--env", help="HOST:PORT of the EnvironmentService that grades them")],
    tolerance: Annotated[float, typer.Option(min=0.0, help="Largest reward difference that still agrees")] = 1e-6,
    concurrency: Annotated[int, typer.Option(min=1, help="Verify calls in flight at once")] = 16,
    timeout: Annotated[float, typer.Option(help="Seconds each Verify may take")] = 60.0,
    token: Annotated[str | None, typer.Option(envvar="SCIPROTO_TOKEN", help="Bearer token (role grader)")] = None,
    ca_cert: Annotated[Path | None, typer.Option(help="PEM CA bundle: use TLS")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON")] = False,
) -> None:
    """Re-score stored rollouts through Verify; list every disagreement; exit 1 if any."""
    from sciproto.channel import ChannelConfig, TlsClientConfig
    from sciproto.client.reverify import verify_rollouts

    if not rollouts.is_file():
        raise SystemExit(f"sciproto verify: {rollouts} is not a file; give a rollouts JSONL file")
    tls = TlsClientConfig(ca_cert=ca_cert) if ca_cert else None
    config = ChannelConfig(target=env, default_timeout_s=timeout, token=token, tls=tls)
    try:
        report = asyncio.run(verify_rollouts(rollouts, config, tolerance=tolerance, concurrency=concurrency,
                                             timeout_s=timeout))
    except ValueError as error:  # a line that is not a rollout record: its first line says which
        raise SystemExit(f"sciproto verify: {str(error).splitlines()[0]}") from None
    typer.echo(report.to_json() if as_json else report.render())
    raise typer.Exit(0 if report.ok else 1)


@app.command()
def version() -> None:
    """Print the software and protocol versions."""
    typer.echo(f"sciproto {__version__} (protocol {PROTOCOL_VERSION})")


@app.command()
def collect(
    env: Annotated[list[str], typer.Option("--env", help="Env server HOST:PORT (repeatable: replicas)")],
    policy: Annotated[list[str], typer.Option("--policy", help="Policy server HOST:PORT (repeatable: replicas)")],
    tasks: Annotated[str, typer.Option(help="ENV:SPLIT, e.g. gsm8k:test")],
    output: Annotated[Path, typer.Option(help="JSONL file of rollouts (appended; resumable)")],
    limit: Annotated[int | None, typer.Option(help="Only the first N tasks of the split")] = None,
    samples: Annotated[int, typer.Option(help="Samples per task (a group)")] = 1,
    concurrency: Annotated[int, typer.Option(help="Episodes in flight at once")] = 16,
    rollouts: Annotated[str | None, typer.Option(
        help="full (token ids, masks, logprobs: what training needs) or summary (without them, far smaller)")] = None,
    config: ConfigOption = None,
    set_: SetOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Run the agent loop over a task split and write one JSON line per rollout."""
    _setup_logging(verbose)
    from clients.collect import main as run_collect

    run_collect(
        env=env, policy=policy, tasks=tasks, output=output, limit=limit, samples=samples,
        concurrency=concurrency, config=config,
        overrides=list(set_ or []) + ([f"rollouts={rollouts}"] if rollouts else []),
    )


@app.command()
def demonstrate(
    env: Annotated[str, typer.Option("--env", help="Env server HOST:PORT")],
    tasks: Annotated[str, typer.Option(help="ENV:SPLIT, e.g. gsm8k:short_train")],
    output: Annotated[Path, typer.Option(help="JSONL file of demonstrations (appended; resumable)")],
    model: Annotated[str, typer.Option(help="Model whose chat template and tokens the demonstrations use")] = "smollm2",
    limit: Annotated[int | None, typer.Option(help="Only the first N tasks of the split")] = None,
    min_reward: Annotated[float, typer.Option(help="Keep episodes the environment scores at least this")] = 1.0,
    max_tokens: Annotated[int | None, typer.Option(help="Drop demonstrations longer than this many tokens")] = None,
    concurrency: Annotated[int, typer.Option(help="Episodes in flight at once")] = 8,
    verbose: VerboseOption = False,
) -> None:
    """Play each task's reference solution through the env server and keep the episodes it scores
    at the top, as rollouts with the model's own tokens (training demonstrations for an sft phase)."""
    _setup_logging(verbose)
    try:
        from clients.demonstrations import main as run_demonstrations

        summary = run_demonstrations(
            env=env, model=model, tasks=tasks, output=output, limit=limit, min_reward=min_reward,
            concurrency=concurrency, max_tokens=max_tokens)
    except ValueError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(summary.as_dict()))


@app.command("eval")
def eval_(
    env: Annotated[list[str], typer.Option("--env", help="Env server HOST:PORT (repeatable: replicas)")],
    tasks: Annotated[str, typer.Option(help="ENV:SPLIT, e.g. gsm8k:test")],
    policy: Annotated[list[str] | None, typer.Option("--policy", help="Policy server HOST:PORT (repeatable)")] = None,
    checkpoint: Annotated[Path | None, typer.Option(help="Checkpoint folder or run directory, served here")] = None,
    model: Annotated[str | None, typer.Option(help="Base model of --checkpoint (default: from its run)")] = None,
    output: Annotated[Path, typer.Option(help="JSON report; rollouts go beside it")] = Path("eval-report.json"),
    limit: Annotated[int | None, typer.Option(help="Only the first N tasks of the split")] = None,
    greedy: Annotated[bool, typer.Option("--greedy/--no-greedy", help="Run the greedy pass (1 sample, T = 0)")] = True,
    samples: Annotated[int, typer.Option(help="Samples per task of the sampled pass (0: none)")] = 0,
    concurrency: Annotated[int, typer.Option(help="Episodes in flight at once")] = 16,
    write_curriculum: Annotated[Path | None, typer.Option(help="Write the sampled pass's mixed tasks here")] = None,
    min_pass_rate: Annotated[float, typer.Option(help="Curriculum keeps tasks with pass rate above this")] = 0.0,
    max_pass_rate: Annotated[float, typer.Option(help="... and below this")] = 1.0,
    config: ConfigOption = None,
    set_: SetOption = None,
    verbose: VerboseOption = False,
    debug: Annotated[bool, typer.Option(help="Show the traceback of an error")] = False,
) -> None:
    """Pass rates of a policy (server or checkpoint) on a split; reward analysis and curriculum."""
    _setup_logging(verbose)
    from clients.eval import main as run_eval

    try:
        run_eval(env=env, policy=list(policy or []), checkpoint=checkpoint, tasks=tasks, output=output,
                 limit=limit, greedy=greedy, samples=samples, concurrency=concurrency,
                 write_curriculum=write_curriculum, min_pass_rate=min_pass_rate, max_pass_rate=max_pass_rate,
                 model=model, config=config, overrides=list(set_ or []))
    except Exception as error:
        if debug:
            raise
        typer.echo(f"sciproto eval: {type(error).__name__}: {error}", err=True)
        raise typer.Exit(2) from None


@app.command()
def train(
    config: Annotated[str, typer.Option("--config", "-c", help="YAML file, or a name in configs/")] = "demo",
    set_: SetOption = None,
    fresh: Annotated[bool, typer.Option(
        "--fresh", help="Start over even when the run directory holds a checkpoint (default: resume)")] = False,
    cluster: Annotated[str | None, typer.Option(
        "--cluster", help="Where the servers run: local (child processes, the default) or ray (Ray actors; "
        "needs the sciproto[ray] extra)")] = None,
    ray_address: Annotated[str | None, typer.Option(
        "--ray-address", help="Ray cluster to join with --cluster ray (default: RAY_ADDRESS, else a local Ray)")] = None,
    verbose: VerboseOption = False,
) -> None:
    """Train end to end: start env, policy and learner servers and the rollout client."""
    _setup_logging(verbose)
    if cluster not in (None, "local", "ray"):
        typer.echo(f"sciproto train: --cluster {cluster!r}: use local or ray", err=True)
        raise typer.Exit(2)
    overrides = (list(set_ or []) + (["run.resume=false"] if fresh else [])
                 + ([f"cluster.engine={cluster}"] if cluster else [])
                 + ([f"cluster.address={ray_address}"] if ray_address else []))
    from clients.train import main as run_train

    run_train(config, overrides)


@app.command()
def view(
    rollouts: Annotated[Path, typer.Argument(help="JSONL file written by `sciproto collect` or `train`")],
    port: Annotated[int, typer.Option(help="Port of the local page (0 = any free)")] = 8765,
    open_browser: Annotated[bool, typer.Option("--open/--no-open", help="Open the page in a browser")] = False,
) -> None:
    """Serve a local page to browse rollouts: table, filters, reward histogram, transcripts."""
    from clients.viewer import main as serve_viewer

    serve_viewer(rollouts, port=port, open_browser=open_browser)


if __name__ == "__main__":
    main()
