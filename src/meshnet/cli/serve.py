"""``meshnet serve``: one GGUF, one llama.cpp context, the OpenAI API and telemetry."""

from __future__ import annotations

import argparse
import errno
import logging
import socket
import ssl
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from meshnet.artifacts.bundled import BundledModelMissing, bundled_gguf
from meshnet.config import ServeConfig
from meshnet.errors import MeshnetError
from meshnet.httputil import SERVER_KEEP_ALIVE_S, is_loopback

if TYPE_CHECKING:
    from meshnet.gateway.auth import KeyRing
    from meshnet.gateway.origin import HostPolicy

__all__ = ["add_gpu_layers", "bind_socket", "gpu_layers_arg", "resolve_gguf", "run_serve", "serve_app", "setup_logging"]

log = logging.getLogger("meshnet")


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before loading anything, so a taken port fails in a second, not after the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise SystemExit(f"meshnet: port {port} on {host} is already in use; pick another with --port") from None
        raise SystemExit(f"meshnet: cannot bind {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def resolve_gguf(path: Path | None, command: str) -> Path:
    """``--gguf`` if given, else the bundled model; a clear exit when neither is there."""
    try:
        return Path(path) if path else bundled_gguf()
    except BundledModelMissing as exc:
        raise SystemExit(f"meshnet {command}: {exc}") from None


def add_allow_uncertified(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-uncertified",
        action="store_true",
        help="run an architecture whose layer-split route is not certified (docs/models.md): text may be wrong",
    )


def whole_at_least(text: str, least: int, what: str) -> int:
    """``text`` as a whole number of at least ``least``, else argparse's error expecting ``what``."""
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def gpu_layers_arg(text: str) -> int:
    """An argparse type for ``--gpu-layers``: ``all`` is -1 (every layer), else a whole number >= 0."""
    if text.strip().lower() == "all":
        return -1
    return whole_at_least(text, 0, "all or a whole number of layers (0: CPU only)")


def add_gpu_layers(parser: argparse.ArgumentParser, *, what: str = "the model") -> None:
    """``--gpu-layers N|all``, llama-server's ``--n-gpu-layers`` (docs/backends.md, "GPU offload")."""
    parser.add_argument(
        "--gpu-layers",
        type=gpu_layers_arg,
        default=0,
        metavar="N|all",
        help=f"layers of {what} llama.cpp offloads to the GPU: all, or N (the last N, the output layer counting "
        "as one; default 0: CPU only). Needs llama-cpp-python built with a GPU backend: make install "
        "LLAMA_BACKEND=cuda|vulkan|metal",
    )


def check_certified(gguf: Path, command: str, *, allow: bool, backend: str = "llama") -> bool:
    """False (the reason printed) when ``gguf``'s architecture has no certified layer-split route
    on ``backend`` and ``allow`` (``--allow-uncertified``) is not set; a warning when it is."""
    from meshnet.artifacts.shard_file import read_architecture
    from meshnet.models.families import require_certified

    try:
        warning = require_certified(read_architecture(gguf), backend=backend, allow_uncertified=allow)
    except MeshnetError as exc:
        print(f"meshnet {command}: {exc.message}", file=sys.stderr)
        return False
    if warning:
        print(f"meshnet {command}: warning: {warning}", file=sys.stderr, flush=True)
    return True


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per hop request is noise, and slow


def add_chat_template(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--chat-template-file",
        type=Path,
        default=None,
        help="a Jinja chat template to use instead of the GGUF's tokenizer.chat_template (as llama-server's); "
        "a template that renders `tools` gets tool calls in its native style (docs/api.md)",
    )


def read_chat_template(path: Path | None, who: str) -> str | None:
    """The template file's text; a file that is missing, unreadable or not a Jinja template exits 2."""
    if path is None:
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        usage_error(f"meshnet {who}: --chat-template-file {path}: {exc}")
    from meshnet.gateway.chat_template import ChatTemplate

    try:
        ChatTemplate(text, bos_token="", eos_token="")
    except MeshnetError as exc:
        usage_error(f"meshnet {who}: --chat-template-file {path}: {exc.message}")
    return text


def usage_error(message: str) -> NoReturn:
    """A command line that cannot work: say why on stderr and exit 2 (argparse's code for usage errors)."""
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(2)


def add_api_keys(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-keys",
        type=Path,
        default=None,
        help="file of API keys clients must send as 'Authorization: Bearer KEY': one per line, or JSON with "
        "per-key limits (docs/security.md); without it the API is open, which only loopback allows",
    )
    parser.add_argument(
        "--no-auth",
        action="store_true",
        help="serve the API without keys on a non-loopback --host (anyone who can reach it may use it)",
    )
    parser.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a DNS name clients reach this gateway by (repeatable), e.g. a reverse proxy's public name; "
        "IP addresses and localhost always work, a request naming any other Host is refused (DNS rebinding)",
    )


def host_policy(args: argparse.Namespace) -> HostPolicy:
    """The names of ``--allowed-host`` (gateway.origin)."""
    from meshnet.gateway.origin import HostPolicy

    return HostPolicy.of(args.allowed_host)


def api_keys_for(args: argparse.Namespace, who: str) -> KeyRing | None:
    """The keys of ``--api-keys``; no keys only on loopback or with ``--no-auth`` (else exit 2)."""
    from meshnet.gateway.auth import load_keys

    if args.api_keys is not None:
        if args.no_auth:
            usage_error(f"meshnet {who}: --api-keys and --no-auth contradict each other; give one of them")
        try:
            return load_keys(args.api_keys)
        except ValueError as exc:
            usage_error(f"meshnet {who}: --api-keys: {exc}")
    if not is_loopback(args.host) and not args.no_auth:
        usage_error(
            f"meshnet {who}: --host {args.host} serves the API beyond this machine, so it needs --api-keys FILE "
            "(clients send 'Authorization: Bearer KEY'); give --no-auth to let anyone who can reach it use it"
        )
    return None


# Headers of one request, together: a grammar of MAX_GRAMMAR_BYTES, JSON-escaped, fits with room to spare.
MAX_HEADER_BYTES = 512 * 1024


def serve_app(
    app: Any, sock: socket.socket, *, tls: ssl.SSLContext | None = None, on_start: Callable[[Any], None] | None = None
) -> None:
    """Serve ``app`` on a bound socket until SIGINT/SIGTERM (in-flight responses finish first).
    With ``tls`` (``security.tls.server_context``) it serves HTTPS, and each request carries its
    client's certificate in the ASGI "tls" extension (``security.transport``).

    The caller has announced the socket already ("listening on"), so a Ctrl-C can arrive while
    uvicorn is still being imported: that is a clean stop too, with nothing started."""
    try:
        import uvicorn

        from meshnet.node.direct_ws import websocket_protocol

        extra: dict[str, Any] = {"ws": websocket_protocol()}
        if tls is not None:
            from meshnet.security.transport import peer_protocols

            http, ws = peer_protocols(websocket_protocol())
            extra = {"http": http, "ws": ws, "ssl_context_factory": lambda *_: tls, "proxy_headers": False}
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=5,
            timeout_keep_alive=SERVER_KEEP_ALIVE_S,
            # a session's first hop request carries its grammar in a header (sampling.MAX_GRAMMAR_BYTES)
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
            # the decode channel (nodes): websockets' sans-I/O protocol with direct messages (node.direct_ws),
            # no compression (tensors do not compress)
            ws_per_message_deflate=False,
            **extra,
        )
        server = uvicorn.Server(config)
        if on_start is not None:  # e.g. an auto-placed node's drain sets server.should_exit to move (node.placement)
            on_start(server)
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # uvicorn re-raises the Ctrl-C it already handled by shutting down gracefully: a clean stop
    finally:
        sock.close()


def _config(args: argparse.Namespace) -> ServeConfig:
    gguf = resolve_gguf(args.gguf, "serve")
    try:
        return ServeConfig(
            gguf=gguf,
            host=args.host,
            port=args.port,
            threads=args.threads,
            ctx=args.ctx,
            batch=args.batch,
            model_id=args.model_id,
            max_queue=args.max_queue,
            max_body_mb=args.max_body_mb,
        )
    except ValueError as exc:
        raise SystemExit(f"meshnet serve: {exc}") from None


def _offloaded(gpu_layers: int) -> str:
    """The start-up line's note of the offload and the GPUs it goes to (``""`` on the CPU)."""
    if gpu_layers == 0:
        return ""
    from meshnet.backends.gpu import gpu_devices, gpu_label, gpu_layers_flag

    return f", --gpu-layers {gpu_layers_flag(gpu_layers)} on {gpu_label(gpu_devices()) or 'no GPU llama.cpp lists'}"


def run_serve(args: argparse.Namespace) -> int:
    setup_logging()
    config = _config(args)
    template = read_chat_template(args.chat_template_file, "serve")
    keys = api_keys_for(args, "serve")
    sock = bind_socket(config.host, config.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{host}:{port}"

    from meshnet.backends.llama_full import LlamaFullEngine
    from meshnet.gateway import create_app

    size_mib = config.gguf.stat().st_size / 2**20 if config.gguf.exists() else 0
    print(f"meshnet: loading {config.gguf} ({size_mib:.0f} MiB) ...", flush=True)
    started = time.monotonic()
    try:
        engine = LlamaFullEngine(
            config.gguf,
            n_ctx=config.ctx,
            n_threads=config.threads,
            n_batch=config.batch,
            model_id=config.model_id,
            url=url,
            gpu_layers=args.gpu_layers,
        )
    except MeshnetError as exc:
        sock.close()
        print(f"meshnet serve: {exc.message}", file=sys.stderr)
        return 2
    except ValueError as exc:  # llama-cpp-python's way of saying the file did not load
        sock.close()
        print(f"meshnet serve: llama.cpp could not load {config.gguf}: {exc}", file=sys.stderr)
        return 2
    info = engine.info
    app = create_app(
        engine,
        max_queue=config.max_queue,
        max_body_bytes=int(config.max_body_mb * 2**20),
        chat_template=template,
        api_keys=keys,
        allowed_hosts=host_policy(args),
    )
    print(
        f"meshnet: {info.model_id} ({info.architecture}, {info.quantization}, {info.n_layers} layers) "
        f"loaded in {time.monotonic() - started:.1f}s; context cap {engine.n_ctx} tokens, "
        f"{engine.n_threads} threads{_offloaded(engine.gpu_layers)}",
        flush=True,
    )
    print(f"meshnet: OpenAI API on {url}/v1")
    print(f"meshnet: telemetry {url}/v1/generations/ID/events, metrics {url}/metrics")
    print(f"meshnet: listening on {url}", flush=True)

    try:
        serve_app(app, sock)
    finally:
        engine.close()
    print("meshnet: stopped", flush=True)
    return 0
