"""The models one gateway serves, by id, and how it learns the others its tracker knows.

A gateway starts with one model (``--gguf``, or ``--manifest``: its vocabulary artifact) and learns
more from its tracker (tracker.models): nodes serving from a manifest hand it to the tracker, and
``GET /v1/models`` there names, per model id, the manifests its live nodes serve. For a model it does
not serve yet, the gateway reads the manifest and its torrent back from the tracker, verifies them
against the digest, and turns them into an engine with ``learn`` (the CLI's: fetch the vocabulary
artifact over BitTorrent or a web seed, load it vocab-only, a route engine over it). One engine per
model id: a request's ``model`` picks the engine, and the engine asks the tracker for a route of
that model's nodes only.

``GET /v1/models`` lists the served models the swarm can route end to end right now (the tracker's
``routable``); a gateway without a tracker (``meshnet serve``) lists what it holds.

Concurrency: the learning thread adds entries; request handlers read them. Entries live in a dict
that is replaced whole under a lock, so a reader (no lock) sees the old one or the new one.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from meshnet.artifacts.manifest import MANIFEST_NAME, parse_manifest
from meshnet.artifacts.vocab import Publication, verify_publication
from meshnet.backends.base import AnyEngine
from meshnet.errors import MeshnetError, Overloaded, UnknownModel
from meshnet.gateway.chat_template import ChatTemplate
from meshnet.gateway.generation import GenerationService
from meshnet.gateway.metrics import GatewayMetrics
from meshnet.gateway.telemetry import TelemetryHub
from meshnet.httputil import tls_or_default

__all__ = ["LEARN_EVERY_S", "Learner", "ModelCatalog", "ServedModel"]

LEARN_EVERY_S = 5.0  # how often the tracker is asked for models this gateway does not serve yet
RETRY_AFTER_S = 30.0  # a publication that could not be learned is tried again after this long
_TIMEOUT_S = 10.0
_log = logging.getLogger("meshnet.gateway")

# A verified publication -> an engine for its model (MeshnetError when it cannot be had).
Learner = Callable[[Publication], AnyEngine]


@dataclass(frozen=True)
class ServedModel:
    """One model the gateway serves: its engine, the queue in front of it, its chat template."""

    engine: AnyEngine
    service: GenerationService
    template: ChatTemplate
    manifest: str | None = None  # the digest it was learned from (None: the gateway's own --gguf/--manifest)

    @property
    def model_id(self) -> str:
        return self.engine.info.model_id


class ModelCatalog:
    def __init__(
        self,
        hub: TelemetryHub,
        metrics: GatewayMetrics,
        *,
        max_queue: int = 64,
        tracker: str | None = None,
        tracker_tls: ssl.SSLContext | None = None,
        learn: Learner | None = None,
        learn_every_s: float = LEARN_EVERY_S,
    ) -> None:
        self.hub = hub
        self.metrics = metrics
        self.max_queue = max_queue
        self.tracker = tracker.rstrip("/") if tracker else None
        self.tracker_tls = tracker_tls
        self.learn = learn if self.tracker else None
        self.learn_every_s = learn_every_s
        self._entries: dict[str, ServedModel] = {}
        self._learned: list[AnyEngine] = []  # engines this catalog made, closed with it
        self._lock = threading.Lock()
        self._failed: dict[str, float] = {}  # digest -> when learning it last failed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- entries -----------------------------------------------------------------------------------
    def add(self, engine: AnyEngine, *, template: str | None = None, manifest: str | None = None) -> ServedModel:
        """Serve ``engine``'s model (``template`` replaces the model's own chat template)."""
        info = engine.info
        entry = ServedModel(
            engine=engine,
            service=GenerationService(engine, self.hub, self.metrics, max_queue=self.max_queue),
            template=ChatTemplate(template or info.chat_template, bos_token=info.bos_token, eos_token=info.eos_token),
            manifest=manifest,
        )
        with self._lock:
            if info.model_id in self._entries:
                entry.service.close()
                raise ValueError(f"model {info.model_id!r} is served already")
            self._entries = {**self._entries, info.model_id: entry}
        return entry

    def entries(self) -> list[ServedModel]:
        return list(self._entries.values())

    def get(self, model: str) -> ServedModel:
        entry = self._entries.get(model)
        if entry is None:
            known = ", ".join(repr(m) for m in self._entries) or "none yet"
            raise UnknownModel(f"model {model!r} is not served here; GET /v1/models lists what is (served: {known})",
                               param="model")  # fmt: skip
        return entry

    async def routable(self) -> list[ServedModel]:
        """The served models the swarm can route end to end right now (all of them without a tracker)."""
        if self.tracker is None:
            return self.entries()
        async with httpx.AsyncClient(timeout=_TIMEOUT_S, verify=tls_or_default(self.tracker_tls)) as client:
            try:
                views = (await client.get(f"{self.tracker}/v1/models")).json()["models"]
                ready = {str(v["id"]) for v in views if v.get("routable") is True}
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                raise Overloaded(f"the tracker at {self.tracker} is unreachable: {exc}", retry_after_s=5) from None
        return [e for e in self.entries() if e.model_id in ready]

    # -- learning ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Learn new models in the background, every ``learn_every_s`` (no-op without a learner)."""
        if self.learn is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._learn_loop, name="meshnet-models", daemon=True)
        self._thread.start()

    def _learn_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.learn_once()
            except Exception:  # a bug must not end learning for the gateway's lifetime; it is logged
                _log.exception("learning models from the tracker failed")
            self._stop.wait(self.learn_every_s)

    def learn_once(self) -> list[str]:
        """Ask the tracker once; serve every model it knows a held manifest of. Returns the ids learned."""
        if self.learn is None or self.tracker is None:
            return []
        learned = []
        with httpx.Client(timeout=_TIMEOUT_S, verify=tls_or_default(self.tracker_tls)) as client:
            try:
                views = client.get(f"{self.tracker}/v1/models").json()["models"]
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                return []  # the next round asks again; requests say the tracker is unreachable
            for view in views if isinstance(views, list) else []:
                model = str(view.get("id")) if isinstance(view, dict) else ""
                if not model or model in self._entries or self._stop.is_set():
                    continue
                for digest in _held_digests(view):
                    if time.monotonic() - self._failed.get(digest, -RETRY_AFTER_S) < RETRY_AFTER_S:
                        continue
                    if self._learn_one(client, model, digest):
                        learned.append(model)
                        break
        return learned

    def _learn_one(self, client: httpx.Client, model: str, digest: str) -> bool:
        assert self.learn is not None
        try:
            publication = self._publication(client, digest)
            if publication.manifest.model_id != model:
                raise UnknownModel(f"its manifest is of model {publication.manifest.model_id!r}, not {model!r}")
            engine = self.learn(publication)
        except MeshnetError as exc:
            self._failed[digest] = time.monotonic()
            _log.warning("cannot serve model %s from manifest %s: %s", model, digest, exc.message)
            return False
        try:
            self.add(engine, manifest=digest)
        except ValueError:  # served meanwhile (the gateway's own model)
            engine.close()
            return False
        self._learned.append(engine)
        _log.info("serving model %s (manifest %s), learned from the tracker", model, digest)
        return True

    def _publication(self, client: httpx.Client, digest: str) -> Publication:
        base = f"{self.tracker}/v1/manifests/{digest}"

        def get(name: str) -> bytes:
            try:
                response = client.get(f"{base}/{name}")
                response.raise_for_status()
            except httpx.HTTPError as exc:
                raise Overloaded(f"cannot read {name} of {digest} from the tracker: {exc}") from None
            return response.content

        document = get(MANIFEST_NAME)
        torrent = get(parse_manifest(document, expect_digest=digest).torrent_file)
        return verify_publication(document, torrent, expect_digest=digest)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * _TIMEOUT_S)
        for entry in self.entries():
            entry.service.close()
        for engine in self._learned:
            engine.close()


def _held_digests(view: Any) -> list[str]:
    manifests = view.get("manifests") if isinstance(view, dict) else None
    if not isinstance(manifests, list):
        return []
    return [str(m["digest"]) for m in manifests if isinstance(m, dict) and m.get("held") is True and "digest" in m]
