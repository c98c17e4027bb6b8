"""The uvicorn server of the app (its shutdown drains the engine; it exits once the engine failed, with
`failed` set, so a supervisor restarts it), and a server in a thread (tests, `bench-serve`)."""

import asyncio
import threading
import time


def import_server():
    """uvicorn, or an ImportError that says how to install the `serve` extra."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise ImportError(f"serving needs FastAPI, uvicorn and prometheus_client ({e}): "
                          f"pip install 'shram_static[serve]'") from e
    return uvicorn


def make_server(app, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 10.0,
                log_level: str = "info"):
    """A `uvicorn.Server` for `app` that drains the app's engine on shutdown and shuts down once the
    engine failed (`.failed`). Run it with `.run()` (main thread: handles signals) or `await .serve()`."""
    uvicorn = import_server()
    engine = app.state.engine

    class DrainingServer(uvicorn.Server):
        failed: str | None = None

        async def on_tick(self, counter: int) -> bool:
            if engine.status == "failed" and self.failed is None:
                self.failed = engine.error or "the engine failed"
                self.should_exit = True
            return await super().on_tick(counter)

        async def shutdown(self, sockets=None):
            for server in self.servers:  # no new connections while the rows drain
                server.close()
            if not self.force_exit:
                await asyncio.to_thread(engine.drain, shutdown_timeout)
            await super().shutdown(sockets)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=max(1, int(shutdown_timeout)))
    return DrainingServer(config)


class ServerThread:
    """Context manager: `app` served on 127.0.0.1 (a free port unless `port` is given) by `make_server`
    in a daemon thread; yields "http://127.0.0.1:PORT". On exit it shuts down as on SIGTERM."""

    def __init__(self, app, port: int = 0, shutdown_timeout: float = 5.0, start_timeout: float = 60.0):
        self.server = make_server(app, "127.0.0.1", port, shutdown_timeout, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, name="shram-static-server", daemon=True)
        self.start_timeout = start_timeout

    def __enter__(self) -> str:
        self.thread.start()
        t0 = time.monotonic()
        while not (self.server.started and self.server.servers):
            if not self.thread.is_alive() or time.monotonic() - t0 > self.start_timeout:
                self.__exit__()
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)
