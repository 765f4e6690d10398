"""What a served connection may take: the header, keep-alive and body timeouts and the
connection cap (`specbudget serve --header-timeout ...`). Apart from the HTTP protocol
that enforces them (http_protocol.py, which imports uvicorn), so the CLI reads their
defaults without loading the server."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConnectionLimits:
    """Seconds and counts; the CLI's defaults (`specbudget serve --help`)."""

    header_timeout: float = 10.0
    keep_alive_timeout: float = 5.0
    body_timeout: float = 30.0
    max_connections: int = 1024

    def __post_init__(self) -> None:
        for name in ("header_timeout", "keep_alive_timeout", "body_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {value}")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be >= 1, got {self.max_connections}")
