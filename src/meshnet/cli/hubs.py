"""``meshnet tracker`` and ``meshnet gateway``: the processes of a swarm besides its nodes."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from meshnet.cli.member_tls import member_tls_for, tracker_tls_for
from meshnet.cli.serve import (
    api_keys_for,
    bind_socket,
    host_policy,
    read_chat_template,
    serve_app,
    setup_logging,
    usage_error,
)
from meshnet.config import PRODUCT_CONTEXT_CAP
from meshnet.errors import MeshnetError

__all__ = ["run_gateway", "run_tracker"]


def run_tracker(args: argparse.Namespace) -> int:
    setup_logging()
    from meshnet.tracker.app import create_tracker_app
    from meshnet.tracker.db import TrackerDB

    sock = bind_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    tls = tracker_tls_for(args, host, port)
    try:
        db = TrackerDB(args.db)
    except ValueError as exc:
        sock.close()
        print(f"meshnet tracker: {exc}", file=sys.stderr)
        return 2
    url = tls.url if tls else f"http://{host}:{port}"
    print(f"meshnet: tracker on {url} (database {db.url_for_display})", flush=True)
    if tls is not None:
        swarm = tls.authority.ca
        print(f"meshnet: private swarm {swarm.swarm_id} from {args.swarm}: members only, over mutual TLS", flush=True)
    print(f"meshnet: listening on {url}", flush=True)
    try:
        if tls is None:
            serve_app(create_tracker_app(db), sock)
        else:
            app = create_tracker_app(
                db, swarm=tls.authority, client_tls=tls.client, max_sessions_per_client=args.max_sessions_per_client
            )
            serve_app(app, sock, tls=tls.server)
    finally:
        db.close()
    return 0


def run_gateway(args: argparse.Namespace) -> int:
    setup_logging()
    if not 0 < args.max_body_mb <= 4096:
        usage_error(f"meshnet gateway: --max-body-mb must be within (0, 4096], got {args.max_body_mb}")
    if args.draft_min > args.draft_tokens:
        usage_error(f"meshnet gateway: --draft-min {args.draft_min} is more than --draft-tokens {args.draft_tokens}")
    template = read_chat_template(args.chat_template_file, "gateway")
    keys = api_keys_for(args, "gateway")
    member = member_tls_for(args, "gateway", "gateway")
    _check_membership(args, keys, member)
    client_tls = member.client_context() if member else None
    sock = bind_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    from meshnet.artifacts.fetch import FetchError
    from meshnet.cli.vocab import gateway_vocab
    from meshnet.gateway import create_app

    try:
        vocab = gateway_vocab(args)  # --gguf, or the vocabulary artifact of --manifest
    except MeshnetError as exc:
        sock.close()
        print(f"meshnet gateway: {exc.message}", file=sys.stderr)
        return 1 if isinstance(exc, FetchError) else 2
    # The model's trained context up to the product cap; the nodes of each route may hold less, and
    # the tracker routes a request only through nodes that hold it (docs/tracker.md).
    trained_cap = min(vocab.info.n_ctx_train, PRODUCT_CONTEXT_CAP)
    cap = trained_cap if args.ctx is None else min(args.ctx, trained_cap)
    try:
        draft = _draft_model(args, vocab, cap)
    except ValueError as exc:
        sock.close()
        vocab.close()
        print(f"meshnet gateway: {exc}", file=sys.stderr)
        return 2
    engines = _Engines(args, client_tls)
    engine = engines.route_engine(vocab, cap, draft)
    if engine.outbox.recovered:
        print(f"meshnet: delivering {engine.outbox.recovered} billing record(s) an earlier gateway left", flush=True)
    url = f"http://{host}:{port}"
    print(f"meshnet: gateway for {vocab.info.model_id} over tracker {args.tracker}; context cap {cap}", flush=True)
    if args.trusted_only:
        print("meshnet: every route over trusted nodes only (--trusted-only)", flush=True)
    print(f"meshnet: OpenAI API on {url}/v1", flush=True)
    print(f"meshnet: listening on {url}", flush=True)
    try:
        app = create_app(
            engine,
            max_queue=args.max_queue,
            swarm_tracker=args.tracker,
            max_body_bytes=int(args.max_body_mb * 2**20),
            chat_template=template,
            api_keys=keys,
            tracker_tls=client_tls,
            learn=engines.learn if args.learn_models == "on" else None,
            allowed_hosts=host_policy(args),
            audits=engines.audits,
        )
        serve_app(app, sock)
    finally:
        engine.close()
        vocab.close()
        engines.close()
        if draft is not None:
            draft.close()
    return 0


DEFAULT_AUDIT_RATE = 0.05


class _Engines:
    """The gateway's route engines: one per model, all alike but for the vocabulary (one billing spool)."""

    def __init__(self, args: argparse.Namespace, client_tls: Any) -> None:
        from meshnet.gateway.billing_outbox import BillingOutbox

        self.args = args
        self.client_tls = client_tls
        self.outbox = BillingOutbox(args.tracker, spool_dir=args.billing_spool, tls=client_tls)
        self.learned: list[Any] = []  # vocabularies of the models learned from the tracker
        self.audits = _audits(args, client_tls)

    def route_engine(self, vocab: Any, n_ctx: int, draft: Any = None) -> Any:
        from meshnet.gateway.route_engine import RouteEngine

        args = self.args
        # A learned model has no draft model of its own: it drafts from the prompt (ngram) instead.
        speculative = "ngram" if args.speculative == "draft" and draft is None else args.speculative
        return RouteEngine(
            vocab,
            args.tracker,
            n_ctx=n_ctx,
            max_concurrency=args.max_concurrency,
            prefill_chunk=args.prefill_chunk,
            prefix_cache=args.prefix_cache == "on",
            kv_snapshots=args.kv_snapshots == "on",
            timeout_s=args.hop_timeout,
            speculative=speculative,
            draft_tokens=args.draft_tokens,
            draft_min=args.draft_min,
            pipeline_rounds=args.pipeline_rounds,
            draft_model=draft,
            decode_channel=args.decode_channel == "on",
            relay=args.relay == "on",
            outbox=self.outbox,
            client_tls=self.client_tls,
            trusted_only=args.trusted_only,
            audits=self.audits,
        )

    def learn(self, publication: Any) -> Any:
        """gateway.catalog's learner: the model's vocabulary artifact, fetched and verified; its engine."""
        from meshnet.cli.vocab import vocab_of

        vocab = vocab_of(publication, self.args)
        self.learned.append(vocab)
        trained_cap = min(vocab.info.n_ctx_train, PRODUCT_CONTEXT_CAP)
        return self.route_engine(vocab, trained_cap if self.args.ctx is None else min(self.args.ctx, trained_cap))

    def close(self) -> None:
        for vocab in self.learned:
            vocab.close()
        if self.audits is not None:
            self.audits.close()


def _audits(args: argparse.Namespace, client_tls: Any) -> Any:
    """Audit sampling at ``--audit-rate`` (default: 0.05 in a private swarm, whose members may be
    untrusted; 0 in an open swarm, which has no trusted auditors); ``None`` at 0."""
    from meshnet.gateway.audits import Audits

    rate = args.audit_rate if args.audit_rate is not None else (DEFAULT_AUDIT_RATE if client_tls is not None else 0.0)
    if not 0.0 <= rate <= 1.0:
        usage_error(f"meshnet gateway: --audit-rate is a fraction of sessions in [0, 1], got {rate}")
    if rate == 0.0:
        return None
    print(f"meshnet: auditing {rate:.1%} of sessions on trusted auditor nodes (--audit-rate)", flush=True)
    return Audits(args.tracker, rate, tls=client_tls)


def _check_membership(args: argparse.Namespace, keys: Any, member: Any) -> None:
    """What the gateway's flags need of its swarm membership (exit 2 saying what is missing)."""
    if member is not None and not args.tracker.startswith("https://"):
        usage_error(f"meshnet gateway: a swarm member talks to its tracker over https, not {args.tracker}")
    trusting = [p.name for p in (keys.policies if keys is not None else ()) if p.trusted_only]
    if (args.trusted_only or trusting) and member is None:
        what = "--trusted-only" if args.trusted_only else f"the trusted_only policy of key(s) {', '.join(trusting)}"
        usage_error(
            f"meshnet gateway: {what} needs a private swarm (--swarm-dir): in an open swarm no node has a "
            "trust tier, so no route would ever qualify"
        )


def _draft_model(args: argparse.Namespace, vocab: Any, n_ctx: int) -> Any:
    """``--speculative draft``: the draft model (``ValueError`` saying what is wrong); else None."""
    if args.speculative != "draft":
        if args.draft_gguf is not None:
            raise ValueError("--draft-gguf drafts only with --speculative draft")
        return None
    if args.draft_gguf is None:
        raise ValueError("--speculative draft needs --draft-gguf PATH: a small GGUF sharing the model's vocabulary")
    from meshnet.backends.llama_draft import DraftModel
    from meshnet.cores import CoreLease

    lease = CoreLease(args.core_lease) if args.core_lease is not None else None
    threads = (os.cpu_count() or 1) if lease is not None else 1  # alone on the lease, else beside the nodes
    print(f"meshnet: loading the draft model {args.draft_gguf} ...", flush=True)
    return DraftModel(
        args.draft_gguf, n_vocab=vocab.info.n_vocab, token_bytes=vocab.token_bytes, n_ctx=n_ctx, threads=threads,
        lease=lease,
    )  # fmt: skip
