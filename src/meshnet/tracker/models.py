"""What the tracker knows of each model: whether its live nodes route it end to end, and the
publications (manifest + torrent) those nodes serve from — what a gateway learns models from.

- ``GET /v1/models``: per model id among the live nodes, its layer count, its nodes, ``routable``
  (``select_routes`` finds a chain of live nodes over every layer; else ``reason`` says where coverage
  breaks) and the manifests its nodes advertise, each with whether the tracker holds its document.
- ``POST /v1/manifests``: a node hands over the publication it serves from, after its registration's
  answer said ``manifest_wanted``. Kept only for a digest a live node advertises, verified (the
  digest is the document's, the torrent is the one it names), and forgotten once no live node
  advertises it (so a tracker holds at most one publication per served manifest).
- ``GET /v1/manifests/{digest}/manifest.json`` and ``GET /v1/manifests/{digest}/{torrent file}``: laid
  out like a publication folder, so that URL works wherever a manifest URL does (``meshnet gateway
  --manifest``, ``meshnet node --manifest``); whoever reads it checks the digest it asked for.

The tracker is no more trusted with a publication than a web server is: it is content-addressed.

Concurrency: the store is used from the tracker's event loop only.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Collection, Container, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from meshnet.artifacts.manifest import MANIFEST_NAME
from meshnet.artifacts.vocab import Publication, verify_publication
from meshnet.errors import InvalidRequest, NotFound, Overloaded
from meshnet.httputil import read_body
from meshnet.tracker.routing import NodeRecord, select_routes

__all__ = [
    "MANIFESTS_PATH",
    "MAX_PUBLICATION_BYTES",
    "ModelView",
    "Publications",
    "model_views",
    "models_routes",
]

MANIFESTS_PATH = "/v1/manifests"
# A v2 torrent keeps 32 bytes per piece: a 300 GiB model in 1 MiB pieces has a 10 MiB torrent (base64: 13).
MAX_PUBLICATION_BYTES = 64 * 2**20


@dataclass(frozen=True, slots=True)
class ModelView:
    """One model id as the live nodes serve it right now."""

    model: str
    total_layers: int  # the layer count most of its nodes report
    nodes: int
    routable: bool
    reason: str | None  # why not, when not routable
    manifests: tuple[str, ...]  # the digests its nodes advertise (sorted)

    def as_json(self, held: Container[str]) -> dict[str, object]:
        return {
            "id": self.model,
            "total_layers": self.total_layers,
            "nodes": self.nodes,
            "routable": self.routable,
            "reason": self.reason,
            "manifests": [{"digest": d, "held": d in held} for d in self.manifests],
        }


def model_views(nodes: Sequence[NodeRecord]) -> list[ModelView]:
    """Every model id among ``nodes``, by id, with whether a chain of them covers all its layers."""
    by_model: dict[str, list[NodeRecord]] = {}
    for node in nodes:
        by_model.setdefault(node.model, []).append(node)
    views = []
    for model, group in sorted(by_model.items()):
        counts = [n.layers.total for n in group]
        reason = None
        try:
            select_routes(group, model, k=1)
        except Overloaded as exc:
            reason = exc.message
        views.append(
            ModelView(
                model=model,
                total_layers=max(set(counts), key=lambda t: (counts.count(t), t)),
                nodes=len(group),
                routable=reason is None,
                reason=reason,
                manifests=tuple(sorted({n.manifest for n in group if n.manifest})),
            )
        )
    return views


class _Offer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    manifest: str = Field(min_length=2)  # the manifest's JSON text
    torrent: str = Field(min_length=4)  # its torrent, base64


class Publications:
    """The publications live nodes serve from, by manifest digest."""

    def __init__(self) -> None:
        self._held: dict[str, Publication] = {}

    def __contains__(self, digest: object) -> bool:
        return digest in self._held

    def get(self, digest: str) -> Publication:
        found = self._held.get(digest)
        if found is None:
            raise NotFound(f"no live node serves manifest {digest} from a publication this tracker holds",
                           param="digest")  # fmt: skip
        return found

    def wanted(self, digest: str | None) -> dict[str, bool]:
        """The registration answer's ask: ``manifest_wanted`` when the node serves from a manifest not held."""
        return {"manifest_wanted": True} if digest and digest not in self._held else {}

    def prune(self, advertised: Collection[str]) -> None:
        for digest in [d for d in self._held if d not in advertised]:
            del self._held[digest]

    def offer(self, raw: bytes, advertised: Collection[str]) -> Publication:
        """Keep the publication in ``raw`` (an ``_Offer``) if a live node advertises its digest."""
        try:
            offer = _Offer.model_validate_json(raw)
            torrent = base64.b64decode(offer.torrent, validate=True)
        except (ValueError, binascii.Error) as exc:
            raise InvalidRequest(
                f'send {{"manifest": "<manifest.json text>", "torrent": "<base64 of its torrent>"}}: {exc}',
                param="body",
            ) from None
        publication = verify_publication(offer.manifest.encode(), torrent)
        if publication.digest not in advertised:
            raise InvalidRequest(
                f"no live node advertises manifest {publication.digest}: register a node serving it first",
                param="manifest",
            )
        self._held[publication.digest] = publication
        return publication


def models_routes(live: Callable[[], Sequence[NodeRecord]], publications: Publications) -> list[Route]:
    """The routes above; ``live()`` returns the live nodes (the tracker's, expired ones dropped)."""

    def advertised() -> set[str]:
        return {n.manifest for n in live() if n.manifest}

    async def list_models(_: Request) -> Response:
        nodes = live()
        publications.prune(advertised())
        return JSONResponse({"models": [v.as_json(publications) for v in model_views(nodes)]})

    async def offer(request: Request) -> Response:
        raw = await read_body(request, MAX_PUBLICATION_BYTES, "the tracker")
        current = advertised()
        publications.prune(current)
        publication = publications.offer(raw, current)  # a ManifestError is a 400 naming the field
        return JSONResponse({"manifest": publication.digest, "model": publication.manifest.model_id}, status_code=201)

    async def document(request: Request) -> Response:
        publication = publications.get(request.path_params["digest"])
        name = request.path_params["name"]
        if name == MANIFEST_NAME:
            return Response(publication.manifest.to_json(), media_type="application/json")
        if name == publication.manifest.torrent_file:
            return Response(publication.torrent, media_type="application/x-bittorrent")
        raise NotFound(f"a publication holds {MANIFEST_NAME} and {publication.manifest.torrent_file}, not {name!r}")

    return [
        Route("/v1/models", list_models, methods=["GET"]),
        Route(MANIFESTS_PATH, offer, methods=["POST"]),
        Route(MANIFESTS_PATH + "/{digest}/{name}", document, methods=["GET"]),
    ]
