"""Which packages the sciproto distribution holds (the rest is in pyproject.toml): every package
of the six top-level folders, and the shipped configs/ folder as `sciproto.configs`, so that
`sciproto train --config demo` finds its YAML in an installed wheel (sciproto/config.py looks
there and in the source tree's configs/)."""

from setuptools import find_packages, setup

PACKAGES = find_packages(include=["sciproto*", "env_servers*", "policy_server*", "learner*", "gateway*", "clients*"])

setup(packages=[*PACKAGES, "sciproto.configs"], package_dir={"sciproto.configs": "configs"})
