"""Artifact plane on loopback: fetch one layer range of the published bundled model with libtorrent,
from one peer and from the HTTP web seed (BEP 19), and the bytes fetched per byte needed.

Everything runs in this process one after another: a seeding libtorrent session (or the Range
server) and a fresh fetching session per round, each into an empty folder.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks.common import Section, median
from meshnet.artifacts.bundled import bundled_gguf
from meshnet.artifacts.fetch import FetchConfig, FetchResult, Swarm, load_source
from meshnet.artifacts.publish import publish
from meshnet.artifacts.webseed import serve_directory

LAYERS = "20:30"  # the largest file: the tail keeps the whole vocabulary
ROUNDS = 3
MIB = 2**20


Peers = tuple[tuple[str, int], ...]


def _fetch(root: Path, path: Path, n: int, *, peers: Peers = (), web_seeds: tuple[str, ...] = ()) -> FetchResult:
    manifest, torrent = load_source(str(path))
    layers = manifest.parse_layers(LAYERS)
    config = FetchConfig(dest=root / f"dl-{n}", layers=layers, peers=peers, web_seeds=web_seeds)
    swarm = Swarm(manifest, torrent, config)
    try:
        return swarm.fetch()
    finally:
        swarm.close()


def run() -> Section:
    section = Section(
        "Artifacts: loopback fetch of a layer range (libtorrent 2.1.1, BitTorrent v2)",
        "python benchmarks/run.py --only artifacts",
    )
    with tempfile.TemporaryDirectory(prefix="meshnet-bench-artifacts-") as tmp:
        root = Path(tmp)
        pub = root / "pub"
        manifest = publish(bundled_gguf(), pub)
        manifest_path = pub / "manifest.json"
        _, torrent = load_source(str(manifest_path))
        seeder = Swarm(manifest, torrent, FetchConfig(dest=pub))
        seeder.fetch()  # every file is already there: a check, then it seeds
        seeder.serve()
        peer = (("127.0.0.1", seeder.listen_port),)
        results: dict[str, list[FetchResult]] = {"peer": [], "web seed": []}
        with serve_directory(pub) as web:
            for i in range(ROUNDS):  # alternate sources so drift on a shared VM hits both alike
                results["peer"].append(_fetch(root, manifest_path, 2 * i, peers=peer))
                results["web seed"].append(_fetch(root, manifest_path, 2 * i + 1, web_seeds=(web.url,)))
        seeder.close()
    needed = results["peer"][0].needed_bytes
    section.add(f"layers {LAYERS}: bytes needed", f"{needed / MIB:.1f} MiB (1 file of {len(manifest.files)})")
    for source, runs in results.items():
        rates = [r.downloaded_bytes / MIB / r.seconds for r in runs]
        ratio = max(r.downloaded_bytes for r in runs) / needed
        section.add(f"from one {source}: throughput (median of {ROUNDS})", f"{median(rates):.1f} MiB/s")
        section.add(f"from one {source}: bytes fetched ÷ bytes needed (worst round)", f"{ratio:.3f}", "≤ 1.05",
                    ratio <= 1.05)  # fmt: skip
    section.notes.append(
        "Seconds run from adding the torrent to the last file verified (SHA-256) and renamed into place, so "
        "they include libtorrent's check of the empty folder, connection setup and our hash pass."
    )
    section.notes.append("Seeder and fetcher share this machine's cores; TCP only, uTP/DHT/LSD/UPnP/NAT-PMP off.")
    return section
