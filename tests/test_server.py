"""The listening socket `tailrace serve` makes before the model loads (api/server.listen)."""

from __future__ import annotations

import asyncio
import socket


from tailrace.api.server import listen


def test_accepted_connections_have_nagle_off() -> None:
    """A response written as headers then body must not wait for the client's delayed ACK."""
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    seen: asyncio.Future = None

    def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted = writer.get_extra_info("socket")
        seen.set_result(accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    async def main() -> int:
        nonlocal seen
        seen = asyncio.get_running_loop().create_future()
        server = await asyncio.start_server(on_connect, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            nodelay = await asyncio.wait_for(seen, 10)
            writer.close()
            return nodelay

    assert asyncio.run(main()) != 0


def test_a_taken_port_is_an_error_and_leaks_no_socket() -> None:
    holder = listen("127.0.0.1", 0)
    try:
        taken = holder.getsockname()[1]
        try:
            listen("127.0.0.1", taken)
        except OSError as exc:
            assert exc.errno is not None
        else:
            raise AssertionError("a second socket bound a port that is in use")
    finally:
        holder.close()
