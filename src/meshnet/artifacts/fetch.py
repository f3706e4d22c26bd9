"""``meshnet fetch``: download the files of a layer range with libtorrent, verify, hold and seed them.

One :class:`Swarm` = one libtorrent session holding the model's torrent. ``fetch()`` runs:

1. **add** the torrent with priority only on the files the range needs (v2: whole files, nothing
   else). A needed file not yet complete lives under ``DEST/.part/<name>/`` (libtorrent's
   ``renamed_files``); complete files live under ``DEST/<name>/``. Peers (``--peer``) and web
   seeds (BEP 19) are given up front; libtorrent prefers whichever delivers.
2. **check**: with no resume data libtorrent hashes what is already on disk, so a fetch killed
   midway resumes from its verified pieces and never re-downloads them.
3. **download**, flushing libtorrent's write cache every second (what a killed fetch has flushed
   survives it), bounded: no wanted byte for ``stall_timeout_s`` (every source dead, or banned for
   bad data — libtorrent bans a web seed whose piece fails its hash) fails with a
   :class:`FetchError` naming the sources and what went wrong, instead of hanging at 99.9 %.
4. **flush** libtorrent's cache (``cache_flushed_alert``), **verify** the SHA-256 of every file
   downloaded in this run against the manifest, then **rename** it into place — atomic per file,
   through libtorrent so it keeps seeding the file from its final path.

The session keeps serving pieces of every complete file it holds until :meth:`Swarm.close`.

Concurrency: a Swarm is driven from one thread; libtorrent runs its own network and disk threads.
"""

from __future__ import annotations

import hashlib
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshnet.artifacts.manifest import ROLE_EMBEDDINGS, Manifest, ManifestError, read_manifest
from meshnet.artifacts.shard_file import merge_shards
from meshnet.artifacts.torrent import TorrentFiles, make_session, read_torrent
from meshnet.errors import InvalidRequest, MeshnetError
from meshnet.fsutil import file_sha256
from meshnet.layers import LayerRange

__all__ = ["PART_DIR", "FetchConfig", "FetchError", "FetchResult", "Progress", "Swarm", "assemble", "load_source"]

PART_DIR = ".part"
_POLL_S = 0.1
_ALERT_WAIT_S = 60.0
_SOURCE_TIMEOUT_S = 30.0
FLUSH_EVERY_S = 1.0
_HASH_TRIES = 3  # hash a completed file, flushing again between tries (see fetch())


class FetchError(MeshnetError):
    """A fetch that could not complete: no source delivered, a file failed verification, disk errors."""

    code = "fetch_failed"


@dataclass(frozen=True, slots=True)
class FetchConfig:
    dest: Path
    layers: LayerRange | None = None  # None: every file
    peers: tuple[tuple[str, int], ...] = ()
    web_seeds: tuple[str, ...] = ()  # added to the manifest's own
    listen: str = "127.0.0.1:0"
    stall_timeout_s: float = 60.0  # no wanted byte for this long: fail
    timeout_s: float | None = None  # the whole fetch
    max_download_rate: int = 0  # bytes/s; 0: unlimited
    files: tuple[str, ...] = ()  # exactly these files of the torrent, by name, instead of ``layers``' files


@dataclass(frozen=True, slots=True)
class Progress:
    state: str
    done: int
    wanted: int
    rate: float  # bytes/s
    peers: int
    web_seeds: int


@dataclass(frozen=True, slots=True)
class FetchResult:
    files: tuple[Path, ...]  # final paths of the needed files
    needed_bytes: int
    resumed_bytes: int  # already on disk and verified when this run started
    downloaded_bytes: int  # payload received in this run (including any that failed its hash)
    verified: int  # files downloaded in this run whose SHA-256 was checked before they moved into place
    hash_failures: int
    seconds: float


@dataclass
class _Events:
    hash_failures: int = 0
    seed_errors: dict[str, str] = field(default_factory=dict)
    banned: int = 0
    flushed: bool = False
    renamed: set[int] = field(default_factory=set)
    fatal: str | None = None


def load_source(ref: str, *, expect_digest: str | None = None) -> tuple[Manifest, bytes]:
    """The manifest at ``ref`` (a path or an http(s) URL) and its torrent (beside it), both verified."""
    if ref.startswith(("http://", "https://")):
        import httpx

        def get(url: str) -> bytes:
            try:
                response = httpx.get(url, timeout=_SOURCE_TIMEOUT_S, follow_redirects=True)
                response.raise_for_status()
            except httpx.HTTPError as exc:
                raise FetchError(f"cannot download {url}: {exc}") from None
            return response.content

        from meshnet.artifacts.manifest import parse_manifest

        manifest = parse_manifest(get(ref), expect_digest=expect_digest)
        torrent = get(urllib.parse.urljoin(ref, manifest.torrent_file))
    else:
        path = Path(ref)
        manifest = read_manifest(path, expect_digest=expect_digest)
        try:
            torrent = (path.parent / manifest.torrent_file).read_bytes()
        except OSError as exc:
            raise InvalidRequest(f"cannot read the torrent beside the manifest: {exc}", param="torrent") from None
    if hashlib.sha256(torrent).hexdigest() != manifest.torrent_sha256:
        raise ManifestError("torrent.sha256", f"{manifest.torrent_file} does not match the manifest's SHA-256")
    return manifest, torrent


def _check_torrent(manifest: Manifest, torrent: TorrentFiles) -> None:
    if torrent.info_hash_v2 != manifest.info_hash_v2:
        raise ManifestError("torrent.info_hash_v2", f"the torrent's v2 info hash is {torrent.info_hash_v2}")
    if torrent.name != manifest.torrent_name:
        raise ManifestError("torrent.name", f"the torrent is named {torrent.name!r}")
    named = [(f"files[{i}]", entry) for i, entry in enumerate(manifest.files)]
    named += [("vocab", entry) for entry in manifest.extra_files]
    for where, entry in named:
        if entry.name not in torrent.index:
            raise ManifestError(f"{where}.name", f"{entry.name} is not in the torrent")
        if torrent.roots[entry.name] != entry.pieces_root:
            raise ManifestError(f"{where}.pieces_root", f"the torrent's merkle root for {entry.name} differs")
        if torrent.sizes[entry.name] != entry.size:
            raise ManifestError(f"{where}.size", f"the torrent gives {entry.name} {torrent.sizes[entry.name]} bytes")


class Swarm:
    """A libtorrent session holding one model's torrent: fetches a layer range, then seeds what it holds."""

    def __init__(self, manifest: Manifest, torrent: bytes, config: FetchConfig) -> None:
        import libtorrent as lt

        self._lt = lt
        self.manifest = manifest
        self.config = config
        self.torrent = read_torrent(torrent)
        self.torrent_bytes = torrent
        _check_torrent(manifest, self.torrent)
        layers = config.layers or LayerRange.full(manifest.layers)
        self.needed = tuple(manifest.file(n) for n in config.files) if config.files else manifest.files_for(layers)
        self.folder = config.dest / manifest.torrent_name
        self._session = make_session(config.listen)
        self._handle: Any = None
        self._events = _Events()

    # -- paths -------------------------------------------------------------------------------------
    def final_path(self, name: str) -> Path:
        return self.folder / name

    def _part_rel(self, name: str) -> str:
        return f"{PART_DIR}/{self.manifest.torrent_name}/{name}"

    def _final_rel(self, name: str) -> str:
        return f"{self.manifest.torrent_name}/{name}"

    @property
    def listen_port(self) -> int:
        return int(self._session.listen_port())

    # -- the fetch ---------------------------------------------------------------------------------
    def fetch(self, progress: Callable[[Progress], None] | None = None) -> FetchResult:
        lt = self._lt
        started = time.monotonic()
        deadline = started + self.config.timeout_s if self.config.timeout_s else None
        needed = {e.name for e in self.needed}
        params = lt.add_torrent_params()
        params.ti = self.torrent.info
        params.save_path = str(self.config.dest)
        n_files = self.torrent.info.layout().num_files()
        priorities = [0] * n_files
        renamed: dict[int, str] = {}
        for name in needed:
            index = self.torrent.index[name]
            priorities[index] = 4
            final, size = self.final_path(name), self.manifest.file(name).size
            if final.is_file() and final.stat().st_size != size:
                part = self.config.dest / self._part_rel(name)
                part.parent.mkdir(parents=True, exist_ok=True)
                final.replace(part)  # a wrong-sized file is unfinished work, not a held file
            if not final.is_file():
                renamed[index] = self._part_rel(name)
        params.file_priorities = priorities
        params.renamed_files = renamed
        params.url_seeds = list(dict.fromkeys((*self.manifest.web_seeds, *self.config.web_seeds)))
        params.peers = list(self.config.peers)
        if self.config.max_download_rate:
            params.download_limit = self.config.max_download_rate
        self.config.dest.mkdir(parents=True, exist_ok=True)
        self._handle = handle = self._session.add_torrent(params)

        status = self._wait_checked(deadline, progress)
        resumed = int(status.total_wanted_done)
        # A needed file at its final path that the check found incomplete goes back under .part.
        file_done = handle.file_progress(lt.torrent_handle.piece_granularity)
        for name in needed:
            index = self.torrent.index[name]
            if index not in renamed and file_done[index] != self.manifest.file(name).size:
                renamed[index] = self._part_rel(name)
                self._rename(index, renamed[index])

        status = self._download(deadline, progress)
        self._flush()
        for rel in renamed.values():
            entry = self.manifest.file(Path(rel).name)
            path = self.config.dest / rel
            for attempt in range(_HASH_TRIES):
                if file_sha256(path) == entry.sha256:
                    break
                if attempt + 1 < _HASH_TRIES:
                    # libtorrent verified every piece: a mismatch this early is most likely bytes
                    # still on their way to disk (a flush alert that was not this flush's). Flush again.
                    self._flush()
            else:
                path.unlink(missing_ok=True)
                raise FetchError(f"{entry.name} completed but its SHA-256 differs from the manifest; deleted it")
        for index, rel in renamed.items():
            self.final_path(Path(rel).name).parent.mkdir(parents=True, exist_ok=True)
            self._rename(index, self._final_rel(Path(rel).name))
        return FetchResult(
            files=tuple(self.final_path(e.name) for e in self.needed),
            needed_bytes=sum(e.size for e in self.needed),
            resumed_bytes=resumed,
            downloaded_bytes=int(status.total_payload_download),
            hash_failures=self._events.hash_failures,
            verified=len(renamed),
            seconds=time.monotonic() - started,
        )

    def _wait_checked(self, deadline: float | None, progress: Callable[[Progress], None] | None) -> Any:
        states = self._lt.torrent_status.states
        checking = (states.checking_files, states.checking_resume_data, states.queued_for_checking)
        while True:
            self._pump()
            status = self._handle.status()
            if status.state not in checking and status.has_metadata:
                return status
            if progress:
                progress(self._progress(status))
            if deadline is not None and time.monotonic() > deadline:
                raise FetchError("timed out checking the files already on disk")
            time.sleep(_POLL_S)

    def _download(self, deadline: float | None, progress: Callable[[Progress], None] | None) -> Any:
        last_done, last_change = -1, time.monotonic()
        last_flush = last_change
        while True:
            self._pump()
            if time.monotonic() - last_flush > FLUSH_EVERY_S:
                # libtorrent 2.1 holds written blocks in memory; a killed process would lose them.
                # Flushed pieces survive, and the next run's check finds them (resume, no re-download).
                self._handle.flush_cache()
                last_flush = time.monotonic()
            status = self._handle.status()
            if progress:
                progress(self._progress(status))
            done, wanted = int(status.total_wanted_done), int(status.total_wanted)
            if done >= wanted:
                return status
            now = time.monotonic()
            if done != last_done:
                last_done, last_change = done, now
            if now - last_change > self.config.stall_timeout_s:
                raise FetchError(self._stalled(status, now - last_change))
            if deadline is not None and now > deadline:
                raise FetchError(f"fetch timed out after {self.config.timeout_s:g} s at {_pct(done, wanted)}")
            time.sleep(_POLL_S)

    def _stalled(self, status: Any, idle: float) -> str:
        done, wanted = int(status.total_wanted_done), int(status.total_wanted)
        seeds = [f"web seed {url}: {why}" for url, why in self._events.seed_errors.items()]
        live = set(self._handle.url_seeds())
        seeds += [f"web seed {url}: delivered nothing" for url in live if url not in self._events.seed_errors]
        parts = [
            f"fetch stalled at {_pct(done, wanted)} ({done:,} of {wanted:,} bytes): no source delivered valid "
            f"data for {idle:.0f} s",
            f"peers connected: {status.num_peers} (given: {len(self.config.peers)})",
            *seeds,
        ]
        if self._events.hash_failures:
            parts.append(f"{self._events.hash_failures} pieces failed their hash check (corrupt data from a source)")
        if not self.config.peers and not live and not self._events.seed_errors:
            parts.append("no sources: pass --peer HOST:PORT or --web-seed URL")
        return "; ".join(parts)

    def _flush(self) -> None:
        """Make every written byte visible on disk before it is hashed, renamed or advertised."""
        # The download loop's periodic flushes leave their cache_flushed alerts behind: read them
        # first, or an old one would pass for this flush and the file be hashed half-written.
        self._pump()
        self._events.flushed = False
        self._handle.flush_cache()
        self._await(lambda: self._events.flushed, "libtorrent's cache flush")

    def _rename(self, index: int, rel: str) -> None:
        self._events.renamed.discard(index)
        self._handle.rename_file(index, rel)
        self._await(lambda: index in self._events.renamed, f"renaming {rel}")

    def _await(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + _ALERT_WAIT_S
        while not ready():
            self._pump()
            if time.monotonic() > deadline:
                raise FetchError(f"libtorrent did not finish {what} within {_ALERT_WAIT_S:g} s")
            time.sleep(_POLL_S / 4)

    def _pump(self) -> None:
        """Read libtorrent's alerts; copy what is needed out of each before the next pop."""
        lt, events = self._lt, self._events
        for alert in self._session.pop_alerts():
            if isinstance(alert, lt.hash_failed_alert):
                events.hash_failures += 1
            elif isinstance(alert, lt.url_seed_alert):
                why = str(alert.error_message()) or str(alert.error.message())
                events.seed_errors[str(alert.server_url())] = why or alert.message()
            elif isinstance(alert, lt.peer_ban_alert):
                events.banned += 1
            elif isinstance(alert, lt.cache_flushed_alert):
                events.flushed = True
            elif isinstance(alert, lt.file_renamed_alert):
                events.renamed.add(int(alert.index))
            elif isinstance(alert, lt.file_rename_failed_alert):
                raise FetchError(f"could not rename a downloaded file into place: {alert.message()}")
            elif isinstance(alert, (lt.file_error_alert, lt.torrent_error_alert)):
                raise FetchError(f"disk error: {alert.message()}")
            elif isinstance(alert, lt.listen_failed_alert):
                raise FetchError(f"cannot listen on {self.config.listen}: {alert.message()}")

    def _progress(self, status: Any) -> Progress:
        return Progress(
            state=str(status.state).rsplit(".", 1)[-1],
            done=int(status.total_wanted_done),
            wanted=int(status.total_wanted),
            rate=float(status.download_payload_rate),
            peers=int(status.num_peers),
            web_seeds=len(self._handle.url_seeds()),
        )

    # -- holding and seeding -----------------------------------------------------------------------
    def held_files(self) -> tuple[str, ...]:
        """Names of the complete files this swarm serves (the needed ones, and any found whole on disk)."""
        done = self._handle.file_progress(self._lt.torrent_handle.piece_granularity)
        return tuple(e.name for e in self.manifest.files if done[self.torrent.index[e.name]] == e.size)

    def serve(self) -> None:
        """Keep seeding: only errors are worth an alert from now on."""
        self._session.apply_settings({"alert_mask": int(self._lt.alert_category.error)})
        self._session.pop_alerts()

    def close(self) -> None:
        if self._handle is not None and self._handle.is_valid():
            self._session.remove_torrent(self._handle)
        self._handle = None
        self._session.pause()


def assemble(manifest: Manifest, dest: Path, layers: LayerRange, cache_dir: Path) -> tuple[Path, Path | None]:
    """The loadable shard file for ``layers`` from fetched files (and the head's embedding table).

    One published range loads its file directly; a union of several is merged once into
    ``cache_dir`` (named by the manifest digest, so a new model version never reuses it).
    """
    groups = manifest.groups_for(layers)
    folder = dest / manifest.torrent_name
    shards = [folder / next(n for n in names if manifest.file(n).role != ROLE_EMBEDDINGS) for _, names in groups]
    embd_names = [n for n in groups[0][1] if manifest.file(n).role == ROLE_EMBEDDINGS]
    embeddings = folder / embd_names[0] if embd_names else None
    if len(shards) == 1:
        return shards[0], embeddings
    out = cache_dir / f"{manifest.torrent_name}.{manifest.digest[7:23]}.{layers.start}-{layers.stop}.gguf"
    if not out.is_file():
        merge_shards(shards, out)
    # A merged shard that reaches the tail keeps the tail's full vocabulary and embeds tokens itself.
    return out, None if layers.is_tail else embeddings


def _pct(done: int, wanted: int) -> str:
    return f"{100.0 * done / wanted:.1f}%" if wanted else "100%"
