"""serve/item_queue.py: the per-request queue of engine items keeps order, wakes its reader,
and says so when empty or read twice at once."""
import asyncio

import pytest

from dsv4.serve.item_queue import ItemQueue


def test_items_come_out_in_order_and_the_reader_waits_for_the_next():
    async def scenario():
        q = ItemQueue()
        with pytest.raises(asyncio.QueueEmpty):
            q.get_nowait()
        for i in range(3):
            q.put_nowait(i)
        assert not q.empty() and q.qsize() == 3
        assert [q.get_nowait(), await q.get(), q.get_nowait()] == [0, 1, 2] and q.empty()
        reader = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        assert not reader.done()            # nothing to read: it waits
        q.put_nowait("a")
        q.put_nowait("b")
        assert await reader == "a" and q.get_nowait() == "b"
        second = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="one reader"):
            await q.get()
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        q.put_nowait("c")                   # a cancelled reader leaves the queue usable
        assert await q.get() == "c"

    asyncio.run(scenario())
