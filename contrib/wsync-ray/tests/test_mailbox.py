"""The mailbox actor's body on its own (no Ray): what a worker takes when posts arrive out of order."""

from __future__ import annotations

import asyncio

from wsync_ray.mailbox import Mailbox


def test_a_post_older_than_one_a_worker_got_never_replaces_it() -> None:
    async def scene() -> list:
        box = Mailbox()
        await box.hello(0, "t0", [])
        await box.hello(1, "t1", [])
        await box.post(2, [0, 1], b"two", ["ref2"])
        await box.post(1, [0, 1], b"one", ["ref1"])  # run after the newer one: Ray may do that
        first = await box.take(0, "t0", 0.0)
        await box.post(3, [0], b"three", ["ref3"])
        await box.post(2, [0], b"two", ["ref2"])  # already taken by worker 0: not again
        return [first, await box.take(1, "t1", 0.0), await box.take(0, "t0", 0.0), await box.take(0, "t0", 0.0)]

    first, other, third, empty = asyncio.run(scene())
    assert first == ["data", 2, b"two", ["ref2"]]
    assert other == ["data", 2, b"two", ["ref2"]]
    assert third == ["data", 3, b"three", ["ref3"]]
    assert empty == ["none"]
