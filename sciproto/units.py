"""Byte units, for sizes written in code and config defaults."""

MiB = 1024 * 1024
GiB = 1024 * MiB
