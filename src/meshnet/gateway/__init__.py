"""The gateway: OpenAI-compatible API, token streaming and Generation Telemetry."""

from meshnet.gateway.app import create_app

__all__ = ["create_app"]
