"""``meshnet chat``: stream an answer in the terminal with a live status line (phase, tokens, tok/s)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from meshnet.httputil import error_message

__all__ = ["run_chat", "stream_chat"]

_TIMEOUT = httpx.Timeout(connect=5.0, read=120.0, write=30.0, pool=5.0)


class ChatError(Exception):
    pass


@dataclass
class Reply:
    text: str = ""
    status: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None


def stream_chat(client: httpx.Client, url: str, payload: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(text delta, telemetry snapshot)`` for each chunk of an OpenAI chat stream."""
    with client.stream("POST", f"{url}/v1/chat/completions", json={**payload, "stream": True}) as response:
        if response.status_code != 200:
            response.read()
            raise ChatError(error_message(response))
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise ChatError(chunk["error"].get("message", "the server reported an error"))
            delta = ""
            finish = None
            for choice in chunk.get("choices", []):
                delta += choice.get("delta", {}).get("content") or ""
                finish = choice.get("finish_reason") or finish
            status = dict(chunk.get("meshnet") or {})
            if finish:
                status["finish_reason"] = finish
            yield delta, status


def _status_line(status: dict[str, Any]) -> Text:
    phase = status.get("phase", "connecting")
    parts = [f"[{phase}]"]
    if phase in ("queued", "prefill"):
        parts.append(f"prompt {status.get('prefill_done', 0)}/{status.get('prompt_tokens', 0)}")
    parts.append(f"{status.get('completion_tokens', 0)} tokens")
    parts.append(f"{status.get('tokens_per_second', 0.0):.1f} tok/s")
    if status.get("elapsed") is not None:
        parts.append(f"{status['elapsed']:.1f}s")
    if status.get("model"):
        parts.append(f"{status['model']} {status.get('quantization', '')}".strip())
    return Text("  ".join(parts), style="dim")


def _ask(client: httpx.Client, console: Console, url: str, payload: dict[str, Any], show_status: bool) -> Reply:
    reply = Reply()
    if not console.is_terminal or not show_status:
        for delta, status in stream_chat(client, url, payload):
            reply.text += delta
            reply.status = status or reply.status
            console.file.write(delta)
            console.file.flush()
        console.file.write("\n")
    else:
        with Live(_status_line({}), console=console, refresh_per_second=12, transient=False) as live:
            for delta, status in stream_chat(client, url, payload):
                reply.text += delta
                reply.status = status or reply.status
                live.update(Group(Text(reply.text), _status_line(reply.status)))
            live.update(Text(reply.text))
    if show_status:
        print(_status_line(reply.status).plain.replace("[", "(").replace("]", ")"), file=sys.stderr)
    return reply


def _default_model(client: httpx.Client, url: str) -> str:
    response = client.get(f"{url}/v1/models")
    if response.status_code != 200:
        raise ChatError(error_message(response))
    models = response.json().get("data", [])
    if not models:
        raise ChatError(f"{url} serves no model")
    return str(models[0]["id"])


def run_chat(args: argparse.Namespace) -> int:
    console = Console(highlight=False)
    url = args.url.rstrip("/")
    with httpx.Client(timeout=_TIMEOUT) as client:
        try:
            model = args.model or _default_model(client, url)
            messages: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
            payload = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature}
            if args.prompt is not None:
                messages.append({"role": "user", "content": args.prompt})
                _ask(client, console, url, {**payload, "messages": messages}, not args.no_status)
                return 0
            console.print(f"[bold]meshnet chat[/] with {model} at {url}  (Ctrl-D or /exit to leave)")
            while True:
                try:
                    line = console.input("[bold cyan]you>[/] ")
                except (EOFError, KeyboardInterrupt):
                    console.print()
                    return 0
                if line.strip() in ("/exit", "/quit"):
                    return 0
                if not line.strip():
                    continue
                messages.append({"role": "user", "content": line})
                reply = _ask(client, console, url, {**payload, "messages": messages}, not args.no_status)
                messages.append({"role": "assistant", "content": reply.text})
        except httpx.ConnectError:
            print(
                f"meshnet chat: cannot reach {url}; is `meshnet serve` (or `make up`) running?",
                file=sys.stderr,
            )
            return 1
        except (httpx.HTTPError, ChatError) as exc:
            print(f"meshnet chat: {exc}", file=sys.stderr)
            return 1
