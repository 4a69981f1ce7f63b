"""Tools for the agent tests; light imports, since each call imports this in a sandbox."""

from __future__ import annotations

import time
from typing import Any

from peerflow.agents.tools import Tool


class Hold(Tool):
    """Sleeps `seconds` and returns its start and end times (`start,end`)."""

    name = "hold"
    description = "Waits."
    parameters = {"type": "object", "properties": {"seconds": {"type": "number"}},
                  "required": ["seconds"]}

    def call(self, arguments: dict[str, Any]) -> str:
        start = time.time()
        time.sleep(arguments["seconds"])
        return f"{start},{time.time()}"


class Raises(Tool):
    name = "raises"
    description = "Raises."

    def call(self, arguments: dict[str, Any]) -> str:
        raise KeyError("no such record")


class Hog(Tool):
    name = "hog"
    description = "Allocates 2 GiB."

    def call(self, arguments: dict[str, Any]) -> str:
        return str(len(bytearray(2 * 2**30)))


class Dial(Tool):
    name = "dial"
    description = "Opens a TCP connection."

    def call(self, arguments: dict[str, Any]) -> str:
        import socket

        socket.create_connection(("127.0.0.1", int(arguments.get("port", 9))), timeout=2)
        return "connected"


class Chatty(Tool):
    name = "chatty"
    description = "Prints, then returns."

    def call(self, arguments: dict[str, Any]) -> str:
        print("not part of the result")
        return "result"
