"""`python -m sciproto`: the installed `sciproto` command.

The command line is an application above this library (`clients/cli.py`); the library names no
application, so this runs whatever the sciproto distribution declares as its `sciproto` console
script. Only that distribution's entry points are read (well under a millisecond), not those of
every distribution installed (about 30 ms in a full environment, at every server start).
"""

from importlib.metadata import PackageNotFoundError, distribution


def main() -> None:
    try:
        commands = [point for point in distribution("sciproto").entry_points
                    if point.group == "console_scripts" and point.name == "sciproto"]
    except PackageNotFoundError:
        commands = []
    if not commands:
        raise SystemExit("python -m sciproto: the sciproto distribution is not installed in this Python;"
                         " install it (pip install -e .) or run `python -m clients.cli`")
    commands[0].load()()


main()
