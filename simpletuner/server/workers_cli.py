"""``simpletuner workers``: a server's workers and worker tokens (with the API token).

    simpletuner workers list
    simpletuner workers token create NAME      prints the token once; give it to `simpletuner worker`
    simpletuner workers token list
    simpletuner workers token revoke ID        its workers are refused; their jobs go back to the queue
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .client import DEFAULT_SERVER, Client, ClientError, resolve_token


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default=os.environ.get("SIMPLETUNER_SERVER", DEFAULT_SERVER),
                        help=f"server URL (default $SIMPLETUNER_SERVER or {DEFAULT_SERVER})")
    parser.add_argument("--token-file", type=Path, default=None,
                        help="read the API token from this file (default $SIMPLETUNER_API_TOKEN)")
    parser.add_argument("--json", action="store_true", help="print raw JSON")
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    sub.add_parser("list", help="the server's workers (its own machine first)")
    token = sub.add_parser("token", help="worker tokens").add_subparsers(dest="token_action", metavar="ACTION",
                                                                          required=True)
    create = token.add_parser("create", help="create a worker token (printed once)")
    create.add_argument("name")
    token.add_parser("list", help="list worker tokens")
    revoke = token.add_parser("revoke", help="revoke a worker token")
    revoke.add_argument("id", type=int)


def _ago(t: float | None) -> str:
    return "-" if not t else f"{max(0.0, time.time() - t):.0f}s ago"


def run(args: argparse.Namespace) -> int:
    try:
        client = Client(args.server, resolve_token(args))
        try:
            if args.action == "list":
                out = client.get("/api/workers")
                lines = [f"{w['name']:<28} {w['status']:<8} "
                         f"{'devices ' + ','.join(w['devices']) if w['devices'] else str(w['slots']) + ' CPU slot(s)':<20}"
                         f" jobs {','.join(str(j['job_id']) for j in w['jobs']) or '-':<10} "
                         f"heartbeat {_ago(w.get('heartbeat_at')) if not w['local'] else 'local'}" for w in out]
            elif args.token_action == "create":
                out = client.post("/api/worker-tokens", {"name": args.name})
                lines = [f"worker token {out['id']} ({out['name']}): {out['token']}",
                         "shown once: store it in a file (mode 600) and start the worker with "
                         "`simpletuner worker --server URL --token-file FILE`"]
            elif args.token_action == "list":
                out = client.get("/api/worker-tokens")
                lines = [f"{t['id']:>4}  {t['name']:<28} "
                         f"{'revoked' if t['revoked_at'] else 'active':<8} last used {_ago(t['last_used_at'])}"
                         for t in out]
            else:
                out = client._check(client.http.delete(f"/api/worker-tokens/{args.id}"))
                lines = [f"worker token {out['id']} ({out['name']}) revoked"]
        finally:
            client.close()
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=2) if args.json else "\n".join(lines))
    return 0
