"""`python -m sciproto`: the installed `sciproto` command.

The command line is an application above this library (`clients/cli.py`); the library names no
application, so this runs whatever the distribution declares as its `sciproto` console script.
"""

from importlib.metadata import entry_points


def main() -> None:
    commands = entry_points(group="console_scripts", name="sciproto")
    if not commands:
        raise SystemExit("python -m sciproto: the sciproto distribution is not installed in this Python;"
                         " install it (pip install -e .) or run `python -m clients.cli`")
    next(iter(commands)).load()()


main()
