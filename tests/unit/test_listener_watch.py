"""A worker watches its own gRPC port (``services.runtime.serve.watch_listener``): it gives up
only after ``probes`` refused connections in a row, never while the port accepts."""
from __future__ import annotations

import asyncio

from services.runtime.process import refuses_connections
from services.runtime.serve import watch_listener


def test_refused_only_when_nothing_listens():
    async def run():
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        accepting = await refuses_connections("127.0.0.1", port)
        server.close()
        await server.wait_closed()
        return accepting, await refuses_connections("127.0.0.1", port)

    assert asyncio.run(run()) == (False, True)


def test_watch_returns_after_refusals_in_a_row_and_not_while_accepting():
    async def run():
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        watch = asyncio.ensure_future(watch_listener("127.0.0.1", port, 0.01, probes=3))
        await asyncio.sleep(0.2)  # ~20 probes, all accepted
        still_watching = not watch.done()
        server.close()
        await server.wait_closed()
        await asyncio.wait_for(watch, timeout=5)
        return still_watching

    assert asyncio.run(run())

