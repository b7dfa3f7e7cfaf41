"""Request ids: unique within a process, and a forked child does not repeat its parent's."""

from __future__ import annotations

import os

from sciproto.client.env import new_request_id


def test_request_ids_are_unique_and_a_forked_child_starts_its_own() -> None:
    ids = [new_request_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: report the next id it would use, then leave at once
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.close(write)
    try:
        child_id = os.read(read, 200).decode()
    finally:
        os.close(read)
        os.waitpid(child, 0)
    parent_next = new_request_id()
    prefix = lambda request_id: request_id.rsplit("-", 1)[0]
    assert prefix(child_id) != prefix(parent_next), (child_id, parent_next)
    assert child_id not in ids and child_id != parent_next
