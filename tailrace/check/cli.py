"""`tailrace check --base-url URL`: its flags, and what runs it."""

from __future__ import annotations

import argparse
import logging

from tailrace import envs
from tailrace.check.results import GROUPS


def group_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_check_parser(sub: argparse._SubParsersAction) -> None:
    check = sub.add_parser("check", help="find the streaming bugs of any OpenAI-compatible server, check by check")
    check.add_argument("--base-url", required=True, help="server URL, with or without /v1")
    check.add_argument("--model", default=None, help="model name (default: the first one the server lists)")
    check.add_argument("--api-key", default=envs.optional("OPENAI_API_KEY"),
                       help="bearer key (default: $OPENAI_API_KEY); with one, a request without it must get 401")
    check.add_argument("--only", type=group_list, default=None, metavar="GROUPS",
                       help=f"run only these comma-separated groups: {', '.join(GROUPS)}")
    check.add_argument("--skip", type=group_list, default=None, metavar="GROUPS", help="leave these groups out")
    check.add_argument("--json", default=None, metavar="OUT", help="write the verdicts to this JSON file")
    check.add_argument("--junit", default=None, metavar="OUT", help="write the verdicts as JUnit XML for CI")
    check.add_argument("--timeout", type=float, default=60.0, help="longest wait for one request, s (default: 60)")


def openai_root(base_url: str) -> str:
    root = base_url.rstrip("/")
    return root if root.endswith("/v1") else root + "/v1"


def run_check(args: argparse.Namespace) -> int:
    """0 when no check fails, 1 when one does, 2 when the server cannot be checked at all."""
    import httpx

    from tailrace.check.client import Client
    from tailrace.check.report import table, write_json, write_junit
    from tailrace.check.results import FAIL
    from tailrace.check.runner import run_checks, select
    from tailrace.check.session import Session

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the report
    try:
        checks = select(args.only, args.skip)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    base_url = openai_root(args.base_url)
    client = Client(base_url, args.api_key, args.timeout)
    try:
        model = args.model or client.get_json("/models")["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
        print(f"error: cannot list the models at {base_url}/models ({exc}); pass --model")
        client.close()
        return 2
    try:
        results = run_checks(Session(client, model), checks)
    finally:
        client.close()
    print(table(results, base_url, model))
    if args.json:
        write_json(results, args.json, base_url, model)
    if args.junit:
        write_junit(results, args.junit)
    return 1 if any(result.status == FAIL for result in results) else 0
